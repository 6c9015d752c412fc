"""How a colocated vLLM engine joins the training processes (spec §7.2): the environment
vLLM's ``external_launcher`` reads, and the tensor-parallel groups of consecutive ranks.

Layer L2: the standard library and torch.distributed.
"""

from __future__ import annotations

import os
from typing import Any

import torch

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


__all__ = ["MASTER_PORTS", "free_master_port", "set_launcher_env", "tensor_parallel_group"]
