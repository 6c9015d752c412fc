"""Weights over TCP: the wire format of the ``gloo`` weight-transfer backend, shared by both ends.

Layer L2, pure torch: the trainer (:class:`GlooWeightSender`, no vLLM needed) and the vLLM worker
(``grpo_lightning.samplers.vllm_gloo_engine``, loaded inside ``vllm serve`` through our plugin)
build the same :func:`chunk_plan` from the parameters' names, dtypes and shapes, so each chunk is
one ``broadcast`` of a flat ``uint8`` buffer from trainer rank 0 to every worker. It runs where
NCCL cannot (a CPU-only server, or a trainer and server without a shared GPU fabric).

The group is a ``ProcessGroupGloo`` over a ``TCPStore`` that the trainer hosts: it needs no
``torch.distributed.init_process_group``, so it lives beside the training job's own group.
"""

from __future__ import annotations

import datetime
import math
from dataclasses import dataclass
from typing import Iterable, Iterator, Sequence

import torch

#: Bytes per broadcast: large enough that per-call latency is amortised, small enough that the
#: staging buffer is a small fraction of a model.
DEFAULT_CHUNK_BYTES = 64 * 2**20
STORE_PREFIX = "grpo_lightning/weights"


@dataclass(frozen=True)
class TensorMeta:
    """Name, dtype name (``"float32"``, ``"bfloat16"``, ...) and shape of one transferred tensor."""

    name: str
    dtype_name: str
    shape: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype_name)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, name: str, tensor: torch.Tensor) -> "TensorMeta":
        return cls(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def chunk_plan(metas: Sequence[TensorMeta], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[list[int]]:
    """Indices of ``metas`` grouped into consecutive chunks of at most ``chunk_bytes`` (a tensor
    larger than that is a chunk of its own). Both ends compute it, so only metadata travels by HTTP.

    >>> metas = [TensorMeta("a", "float32", (4,)), TensorMeta("b", "float32", (2,)), TensorMeta("c", "float32", (8,))]
    >>> chunk_plan(metas, chunk_bytes=24)
    [[0, 1], [2]]
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes={chunk_bytes}: use a positive number of bytes.")
    chunks: list[list[int]] = []
    size = 0
    for index, meta in enumerate(metas):
        if chunks and size + meta.nbytes <= chunk_bytes:
            chunks[-1].append(index)
            size += meta.nbytes
        else:
            chunks.append([index])
            size = meta.nbytes
    return chunks


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat ``uint8`` CPU buffer holding the tensors' bytes back to back, ``(sum nbytes,)``."""
    parts = [t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    return torch.cat(parts) if len(parts) > 1 else parts[0].clone()


def unpack(buffer: torch.Tensor, metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
    """The tensors of ``metas`` read back from a :func:`pack` buffer."""
    if buffer.numel() != sum(m.nbytes for m in metas):
        raise ValueError(f"Weight chunk of {buffer.numel()} bytes does not match its metadata "
                         f"({sum(m.nbytes for m in metas)} bytes).")
    out, offset = [], 0
    for meta in metas:
        raw = buffer[offset : offset + meta.nbytes].clone()  # own storage: aligned for any dtype
        out.append(raw.view(meta.dtype).reshape(meta.shape))
        offset += meta.nbytes
    return out


@dataclass
class GlooLink:
    """A gloo group and the ``TCPStore`` it met through (the master serves the store: it must
    outlive the group)."""

    group: torch.distributed.ProcessGroup
    store: torch.distributed.Store

    def broadcast(self, buffer: torch.Tensor) -> None:
        self.group.broadcast(buffer, 0).wait()


def process_group(host: str, port: int, rank: int, world_size: int, timeout_s: float, *, is_master: bool) -> GlooLink:
    """A gloo group of ``world_size`` over a ``TCPStore`` at ``host:port`` (hosted by the master,
    the trainer). Blocks until every member joined or ``timeout_s`` passed; every later
    collective fails after ``timeout_s`` instead of hanging."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = torch.distributed.TCPStore(host, port, world_size, is_master=is_master, timeout=timeout,
                                       wait_for_workers=False)
    prefixed = torch.distributed.PrefixStore(STORE_PREFIX, store)
    return GlooLink(torch.distributed.ProcessGroupGloo(prefixed, rank, world_size, timeout), store)


def broadcast_chunks(link: GlooLink, metas: Sequence[TensorMeta],
                     tensors: Iterable[torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Send ``tensors`` (in ``metas`` order) from rank 0, chunk by chunk. Returns the bytes sent."""
    stream = iter(tensors)
    sent = 0
    for chunk in chunk_plan(metas, chunk_bytes):
        parts = []
        for index in chunk:
            tensor = next(stream)
            if tuple(tensor.shape) != metas[index].shape:
                raise ValueError(f"{metas[index].name}: shape {tuple(tensor.shape)} differs from its metadata "
                                 f"{metas[index].shape}.")
            parts.append(tensor.to(metas[index].dtype))
        buffer = pack(parts)
        link.broadcast(buffer)
        sent += buffer.numel()
    return sent


def receive_chunks(link: GlooLink, metas: Sequence[TensorMeta],
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The receiving side of :func:`broadcast_chunks`: yields each chunk's ``(name, tensor)`` list."""
    for chunk in chunk_plan(metas, chunk_bytes):
        chunk_metas = [metas[i] for i in chunk]
        buffer = torch.empty(sum(m.nbytes for m in chunk_metas), dtype=torch.uint8)
        link.broadcast(buffer)
        yield [(m.name, t) for m, t in zip(chunk_metas, unpack(buffer, chunk_metas))]


__all__ = [
    "DEFAULT_CHUNK_BYTES", "GlooLink", "TensorMeta", "broadcast_chunks", "chunk_plan", "pack", "process_group",
    "receive_chunks", "unpack",
]
