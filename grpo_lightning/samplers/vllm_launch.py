"""How a colocated vLLM engine joins the training processes (spec §7.2): the environment
vLLM's ``external_launcher`` reads, the tensor-parallel groups of consecutive ranks and what
their ranks exchange, and an engine shutdown that leaves the trainer's process group alive.

Layer L2: the standard library, torch.distributed and the L0 types.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from grpo_lightning.types import GenerationParams

MASTER_PORTS = (29500, 23456, 12355, 12345)  # TRL's choice order for MASTER_PORT


def set_launcher_env(rank: int, world_size: int) -> None:
    """The variables vLLM's ``external_launcher`` reads (spec §7.2); Lightning's own are kept."""
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    os.environ.setdefault("MASTER_ADDR", "localhost")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_master_port())


def free_master_port() -> int:
    """The first of the conventional ``MASTER_PORTS`` that binds, else a free non-ephemeral port."""
    import socket

    from grpo_lightning.utils.ports import free_port

    for port in MASTER_PORTS:
        with socket.socket() as sock:
            try:
                sock.bind(("localhost", port))
            except OSError:
                continue
            return port
    return free_port()


def tensor_parallel_group(rank: int, world_size: int, tp: int) -> Any:
    """This rank's tensor-parallel group (consecutive ranks) and its members, or None for tp=1.
    Every rank creates every group, as ``new_group`` requires."""
    if tp == 1:
        return None
    mine = None
    for start in range(0, world_size, tp):
        members = list(range(start, start + tp))
        group = torch.distributed.new_group(members)
        if rank in members:
            mine = (group, members)
    return mine


@dataclass(frozen=True)
class GroupRequest:
    """What one rank of a TP group asks the shared engine for in one call."""

    num_generations: int
    params: GenerationParams
    num_prompts: int

    def same_sampling(self, other: "GroupRequest") -> bool:
        return self.num_generations == other.num_generations and self.params == other.params


def group_max(tp_group: tuple[Any, list[int]], count: int) -> int:
    """The largest ``count`` of the ranks of ``tp_group`` (``(group, members)``)."""
    group, members = tp_group
    counts: list[Any] = [None] * len(members)
    torch.distributed.all_gather_object(counts, count, group=group)
    return max(counts)


def gather_group_requests(tp_group: tuple[Any, list[int]], rows: list[Any], num_generations: int,
                          params: GenerationParams) -> tuple[list[Any], list[GroupRequest], range]:
    """Every rank of a group must send the engine the same requests: all the group's prompts,
    each rank's :class:`GroupRequest` in group order (a tool loop's ranks ask for different
    lengths), and which prompts are this rank's."""
    group, members = tp_group
    gathered: list[Any] = [None] * len(members)
    torch.distributed.all_gather_object(gathered, (rows, num_generations, params), group=group)
    position = members.index(torch.distributed.get_rank())
    start = sum(len(g) for g, _, _ in gathered[:position])
    requests = [GroupRequest(n, p, len(g)) for g, n, p in gathered]
    return [r for g, _, _ in gathered for r in g], requests, range(start, start + len(rows))


@contextmanager
def default_group_kept() -> Iterator[None]:
    """vLLM's teardown with the trainer's process group left alive: under ``external_launcher``
    the engine's shutdown calls ``destroy_process_group()``, which destroys the default group,
    and the trainer's next collective (a barrier, a later ``validate``) would fail."""
    dist = torch.distributed
    real = dist.destroy_process_group
    default = dist.distributed_c10d._get_default_group() if dist.is_initialized() else None

    def destroy(group: Any = None) -> None:
        if group is not None and group is not default:
            real(group)

    dist.destroy_process_group = destroy
    try:
        yield
    finally:
        dist.destroy_process_group = real


__all__ = [
    "GroupRequest", "MASTER_PORTS", "default_group_kept", "free_master_port", "gather_group_requests", "group_max",
    "set_launcher_env", "tensor_parallel_group",
]
