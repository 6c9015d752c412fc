"""The gloo weight wire: chunk plans, exact byte round trips, and a real two-member broadcast."""

from __future__ import annotations

import threading

import pytest

from tests.helpers import free_port
import torch

from grpo_lightning.samplers.gloo_wire import (
    TensorMeta, broadcast_chunks, chunk_plan, pack, process_group, receive_chunks, unpack,
)


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed.weight", torch.randn(7, 5, generator=g)),
        ("norm.weight", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("scale", torch.tensor(3.25, dtype=torch.float64)),
        ("lm_head.weight", torch.randn(11, 5, generator=g).to(torch.float16)),
        ("steps", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
    ]


def test_chunk_plan_keeps_order_and_bounds_every_chunk() -> None:
    metas = [TensorMeta.of(n, t) for n, t in _tensors()]
    for limit in (1, 16, 40, 200, 10**6):
        chunks = chunk_plan(metas, limit)
        assert [i for c in chunks for i in c] == list(range(len(metas)))
        for chunk in chunks:
            assert len(chunk) == 1 or sum(metas[i].nbytes for i in chunk) <= limit
    assert chunk_plan(metas, 10**6) == [list(range(len(metas)))]
    with pytest.raises(ValueError, match="chunk_bytes=0"):
        chunk_plan(metas, 0)


def test_pack_unpack_is_bit_exact_for_every_dtype() -> None:
    named = _tensors()
    metas = [TensorMeta.of(n, t) for n, t in named]
    back = unpack(pack([t for _, t in named]), metas)
    for (_, sent), got in zip(named, back):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), sent.reshape(-1).view(torch.uint8))
    with pytest.raises(ValueError, match="does not match its metadata"):
        unpack(torch.zeros(3, dtype=torch.uint8), metas)


def test_broadcast_over_a_real_gloo_group_delivers_every_tensor() -> None:
    named = _tensors()
    metas = [TensorMeta.of(n, t) for n, t in named]
    port, received, errors = free_port(), [], []

    def worker() -> None:
        try:
            group = process_group("127.0.0.1", port, 1, 2, 30.0, is_master=False)
            for chunk in receive_chunks(group, metas, chunk_bytes=64):
                received.extend((n, t.clone()) for n, t in chunk)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    thread = threading.Thread(target=worker)
    thread.start()
    group = process_group("127.0.0.1", port, 0, 2, 30.0, is_master=True)
    sent = broadcast_chunks(group, metas, (t for _, t in named), chunk_bytes=64)
    thread.join(30)
    assert not errors and not thread.is_alive()
    assert sent == sum(m.nbytes for m in metas)
    assert [n for n, _ in received] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, received):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_a_tensor_of_the_wrong_shape_is_refused_before_sending() -> None:
    metas = [TensorMeta("w", "float32", (2, 2))]

    class NoLink:
        def broadcast(self, *args):  # pragma: no cover - must not be reached
            raise AssertionError("sent a tensor whose shape differs from its metadata")

    with pytest.raises(ValueError, match=r"w: shape \(4,\) differs from its metadata \(2, 2\)"):
        broadcast_chunks(NoLink(), metas, [torch.zeros(4)])
