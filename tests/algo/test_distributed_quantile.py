"""The exact distributed quantile: equal to ``torch.quantile`` of every rank's values together."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from grpo_lightning.algo.distributed_quantile import distributed_quantile, order_keys
from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]


class ThreadRanks:
    """``world`` threads in lockstep: ``all_reduce`` sums each call's tensors over the threads."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: list[torch.Tensor | None] = [None] * world
        self.calls = [0] * world

    def reducer(self, rank: int):
        def all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
            assert op == "sum"
            self.calls[rank] += 1
            self.slots[rank] = tensor.clone()
            self.barrier.wait()
            total = torch.stack([t for t in self.slots]).sum(0)
            self.barrier.wait()
            return total

        return all_reduce

    def run(self, shards: list[torch.Tensor], q: float) -> list[torch.Tensor]:
        results: list[torch.Tensor | None] = [None] * self.world
        errors: list[BaseException] = []

        def work(rank: int) -> None:
            try:
                results[rank] = distributed_quantile(shards[rank], q, self.reducer(rank))
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)
                self.barrier.abort()

        threads = [threading.Thread(target=work, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not errors, errors
        return results


def _random_cases(dtype: torch.dtype, count: int):
    g = torch.Generator().manual_seed(1 if dtype == torch.float32 else 2)
    for i in range(count):
        n = int(torch.randint(1, 80, (1,), generator=g))
        x = (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
        if i % 3 == 0:
            x = torch.round(x)  # many ties
        if i % 5 == 0:
            x = x.abs()  # entropies are non-negative
        q = (0.0, 1.0, 0.8, 0.5, 0.2)[i % 5] if i % 4 == 0 else float(torch.rand(1, generator=g))
        yield x, q


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equals_torch_quantile_bit_for_bit_on_one_process(dtype):
    for x, q in _random_cases(dtype, 400):
        got = distributed_quantile(x, q)
        assert got.dtype == dtype
        assert torch.equal(got, torch.quantile(x, q)), (x.tolist(), q)
        # and the exact value, from a float64 sort done by hand (q as the dtype holds it)
        s = torch.sort(x.double()).values
        rank = float(torch.tensor(q, dtype=dtype)) * (len(s) - 1)
        lo, hi = math.floor(rank), math.ceil(rank)
        exact = s[lo] + (rank - lo) * (s[hi] - s[lo])
        # the rank and the interpolation are rounded in the dtype: a few ulps of the value range
        tol = 8 * torch.finfo(dtype).eps * max(1.0, float(s.abs().max()))
        assert abs(float(got) - float(exact)) <= tol


@pytest.mark.parametrize("world", [2, 3])
def test_shards_over_ranks_give_the_quantile_of_their_union(world):
    g = torch.Generator().manual_seed(world)
    for i, (x, q) in enumerate(_random_cases(torch.float32, 60)):
        cuts = sorted(int(c) for c in torch.randint(0, len(x) + 1, (world - 1,), generator=g))
        shards = list(torch.tensor_split(x, cuts))  # uneven, some possibly empty
        ranks = ThreadRanks(world)
        results = ranks.run(shards, q)
        expected = torch.quantile(x, q)
        assert all(torch.equal(r, expected) for r in results), (i, [s.tolist() for s in shards], q)
        assert ranks.calls == [33] * world  # one size reduction + 32 bisection steps, whatever the data


def test_a_single_value_empty_inputs_and_nan():
    assert float(distributed_quantile(torch.tensor([2.5]), 0.3)) == 2.5
    assert math.isnan(float(distributed_quantile(torch.zeros(0), 0.5)))
    assert math.isnan(float(distributed_quantile(torch.tensor([1.0, float("nan")]), 0.5)))
    # a rank without values still takes part, and the others' quantile is returned on both
    results = ThreadRanks(2).run([torch.zeros(0), torch.tensor([3.0, 1.0, 2.0])], 0.5)
    assert [float(r) for r in results] == [2.0, 2.0]
    # nothing anywhere: NaN on every rank
    assert all(math.isnan(float(r)) for r in ThreadRanks(2).run([torch.zeros(0), torch.zeros(0)], 0.5))


def test_signed_zeros_extremes_and_half_precision():
    x = torch.tensor([-0.0, 0.0, -1e-38, 1e-38, -3.0e38, 3.0e38, 7.0, -2.0])
    for q in (0.0, 0.25, 0.5, 0.75, 1.0, 0.3):
        assert torch.equal(distributed_quantile(x, q), torch.quantile(x, q))
    with_inf = torch.tensor([float("inf"), -float("inf"), 1.0, 2.0])
    for q in (0.0, 0.4, 1.0):  # interpolating between equal infinities gives NaN in torch too
        assert torch.allclose(distributed_quantile(with_inf, q), torch.quantile(with_inf, q), equal_nan=True)
    ordered = torch.tensor([-float("inf"), -3.0e38, -2.0, -1e-38, -0.0, 0.0, 1e-38, 7.0, float("inf")])
    assert bool((order_keys(ordered).diff() > 0).all())
    half = torch.tensor([0.5, 0.25, 1.0], dtype=torch.bfloat16)
    assert distributed_quantile(half, 0.5).dtype == torch.float32
    assert float(distributed_quantile(half, 0.5)) == 0.5


def test_more_tokens_than_torch_quantile_accepts():
    """2^25 values (torch.quantile refuses above 2^24): 32 local values on 2^20 identical "ranks",
    simulated by a reduction that multiplies every count by 2^20."""
    local = torch.tensor([float(v) for v in range(32)]).flip(0)
    copies = 2**20

    def all_reduce(tensor: torch.Tensor, op: str) -> torch.Tensor:
        return tensor * copies

    for q in (0.0, 0.2, 0.5, 0.8, 0.999999, 1.0):
        got = float(distributed_quantile(local, q, all_reduce))
        n = 32 * copies
        rank = float(torch.tensor(q, dtype=torch.float32)) * (n - 1)  # float64 rank of the float32 q
        lo, hi = math.floor(rank), math.ceil(rank)
        value = lambda i: float(i // copies)  # noqa: E731 - sorted union: each value repeated
        expected = value(lo) + (rank - lo) * (value(hi) - value(lo))
        assert got == pytest.approx(expected, abs=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="q=1.5"):
        distributed_quantile(torch.ones(3), 1.5)
    with pytest.raises(ValueError, match="1-D"):
        distributed_quantile(torch.ones(2, 2), 0.5)
    with pytest.raises(ValueError, match="floating point"):
        distributed_quantile(torch.ones(3, dtype=torch.long), 0.5)


_CHILD = r"""
import sys, torch, torch.distributed as dist
from grpo_lightning.algo.distributed_quantile import distributed_quantile
rank, port = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
def all_reduce(t, op):
    t = t.clone(); dist.all_reduce(t); return t
g = torch.Generator().manual_seed(0)
values = torch.rand(1001, generator=g) * 5  # the same on both ranks: each takes a different part
values[::7] = values[3]  # ties
mine = values[:400] if rank == 0 else values[400:]
for q in (0.0, 0.2, 0.5, 0.8, 1.0, 0.123):
    got = distributed_quantile(mine, q, all_reduce)
    assert torch.equal(got, torch.quantile(values, q)), (rank, q, float(got))
print("ok", rank)
dist.destroy_process_group()
"""


def test_two_gloo_processes_agree_with_torch_quantile_of_all_values(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), port], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    assert sorted(o.strip() for o, _ in outs) == ["ok 0", "ok 1"]
