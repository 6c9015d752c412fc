"""Trainer-side senders of vLLM's native weight-update protocol, one per transport.

Layer L2. Both drive the same route sequence of a ``vllm serve`` started with
``--weight-transfer-config '{"backend": ...}'``: ``/init_weight_transfer_engine`` once, then per
update ``/start_weight_update`` → ``/update_weights`` (the server receives while the trainer
sends) → ``/finish_weight_update`` with the policy version.

* :class:`GlooSender` (``backend: gloo``, pure torch): our plugin's transport; works with CPU
  servers and needs no vLLM in the trainer's environment.
* :class:`NCCLSender` (``backend: nccl``): vLLM's own NCCL trainer engine (needs ``vllm`` and a
  CUDA device in the trainer; the GPU path of TRL's async trainer).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from grpo_lightning.samplers.gloo_wire import DEFAULT_CHUNK_BYTES, GlooLink, TensorMeta, broadcast_chunks, process_group
from grpo_lightning.samplers.vllm_server_client import VLLMServerClient

WeightStream = Callable[[], Iterable[tuple[str, torch.Tensor]]]


def _in_thread(fn: Callable[[], Any]) -> Callable[[], None]:
    """Start ``fn`` on a thread; the returned ``join`` waits for it and re-raises its error."""
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            fn()
        except BaseException as err:  # noqa: BLE001 - re-raised by join
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True, name="grpo-vllm-route")
    thread.start()

    def join() -> None:
        thread.join()
        if "error" in outcome:
            raise outcome["error"]

    return join


class GlooSender:
    """Sends weights as gloo broadcasts from a group this trainer hosts (rank 0) to every worker.

    Args:
        address: This trainer's address as the server sees it (the workers connect to it).
        port: TCP port of the group's store on this host (TRL ``vllm_group_port``).
        timeout_s: Seconds any rendezvous or broadcast may take before it fails.
        chunk_bytes: Bytes per broadcast (both ends plan the same chunks).
    """

    backend = "gloo"

    def __init__(self, address: str, port: int, timeout_s: float, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        self.address, self.port, self.timeout_s, self.chunk_bytes = address, port, timeout_s, chunk_bytes
        self.link: GlooLink | None = None

    def connect(self, client: VLLMServerClient, workers: int) -> None:
        init_info = dict(master_address=self.address, master_port=self.port, rank_offset=1,
                         world_size=workers + 1, chunk_bytes=self.chunk_bytes, timeout_s=self.timeout_s)
        join = _in_thread(lambda: client.init_weight_transfer_engine(init_info))  # the workers join meanwhile
        self.link = process_group(self.address, self.port, 0, workers + 1, self.timeout_s, is_master=True)
        join()

    def send(self, client: VLLMServerClient, shapes: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
             weights: WeightStream, version: str) -> None:
        assert self.link is not None, "connect() first"
        metas = [TensorMeta(name, str(dtype).removeprefix("torch."), shape) for name, dtype, shape in shapes]
        client.start_weight_update()
        update_info = {"names": [m.name for m in metas], "dtype_names": [m.dtype_name for m in metas],
                       "shapes": [list(m.shape) for m in metas]}
        join = _in_thread(lambda: client.update_weights(update_info))
        try:
            broadcast_chunks(self.link, metas, (tensor for _, tensor in weights()), self.chunk_bytes)
        finally:
            join()
        client.finish_weight_update(version)

    def close(self) -> None:
        self.link = None


class _Source:
    """vLLM ``WeightSource`` over the live policy: the shapes and stream of the current push."""

    def __init__(self) -> None:
        self.shapes: Sequence[tuple[str, torch.dtype, tuple[int, ...]]] = ()
        self.weights: WeightStream = lambda: ()

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, dtype, shape) for name, dtype, shape in self.shapes]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.weights())

    def held_names(self) -> None:
        return None


class NCCLSender:
    """vLLM's NCCL trainer engine (packed broadcasts from this CUDA device to every worker GPU).

    Args:
        address: This trainer's address as the server sees it.
        port: Rendezvous port on this host (TRL ``vllm_group_port``).
    """

    backend = "nccl"

    def __init__(self, address: str, port: int) -> None:
        self.address, self.port = address, port
        self.engine: Any = None
        self.source = _Source()

    def connect(self, client: VLLMServerClient, workers: int) -> None:
        from grpo_lightning.samplers.vllm_common import import_vllm

        import_vllm()
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine

        info = NCCLTrainerInitInfo(master_address=self.address, master_port=self.port, world_size=workers + 1, rank=0)
        self.engine = NCCLTrainerWeightTransferEngine.trainer_init(info, client=_VersionedClient(client),
                                                                   source=self.source)

    def send(self, client: VLLMServerClient, shapes: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
             weights: WeightStream, version: str) -> None:
        self.source.shapes, self.source.weights = shapes, weights
        self.engine.client.version = version
        self.engine.send_weights()  # start → update ∥ broadcast → finish

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


class _VersionedClient:
    """The client vLLM's engine drives, finishing each update with the version being pushed."""

    def __init__(self, client: VLLMServerClient) -> None:
        self.client, self.version = client, None

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.finish_weight_update(self.version if weight_version is None else weight_version)


SENDERS = {"gloo": GlooSender, "nccl": NCCLSender}

__all__ = ["GlooSender", "NCCLSender", "SENDERS"]
