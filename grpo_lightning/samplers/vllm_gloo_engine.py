"""The inference side of the ``gloo`` weight-transfer backend: a vLLM ``WeightTransferEngine``.

Layer L2; imports vLLM at module level, so it is loaded only inside a vLLM process (``vllm serve``
with ``--weight-transfer-config '{"backend": "gloo"}'``), registered there by our vLLM plugin
(:func:`grpo_lightning.samplers.vllm_plugin.register`). It plugs into vLLM's native weight-update
protocol (``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``) exactly like vLLM's NCCL backend, with the bytes carried by a gloo
broadcast (:mod:`grpo_lightning.samplers.gloo_wire`) instead of NCCL: it works on CPU-only
servers, where vLLM's own backends (NCCL, CUDA IPC) cannot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo,
)

from grpo_lightning.samplers.gloo_wire import DEFAULT_CHUNK_BYTES, GlooLink, TensorMeta, process_group, receive_chunks


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Where the trainer's store listens, this worker's rank offset in the group, the group size
    (workers + 1 trainer), the chunk size both ends plan with and the collective timeout."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    timeout_s: float = 600.0


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """The tensors of one update, in sending order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"update_info has {len(self.names)} names, {len(self.dtype_names)} dtype_names and "
                             f"{len(self.shapes)} shapes: they must be equally long.")

    def metas(self) -> list[TensorMeta]:
        return [TensorMeta(n, d, tuple(s)) for n, d, s in zip(self.names, self.dtype_names, self.shapes)]


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Receives checkpoint-format weights from trainer rank 0 over gloo and loads them through
    vLLM's layerwise reload (which also re-packs weights the CPU back-end keeps in its own layout)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.link: GlooLink | None = None
        self.chunk_bytes = DEFAULT_CHUNK_BYTES

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        parallel = self.parallel_config
        worker_rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.chunk_bytes = init_info.chunk_bytes
        self.link = process_group(init_info.master_address, init_info.master_port,
                                  init_info.rank_offset + worker_rank, init_info.world_size, init_info.timeout_s,
                                  is_master=False)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronises the accelerator afterwards; gloo receives are complete on return.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.link is None:
            raise RuntimeError("gloo weight transfer is not initialised: POST /init_weight_transfer_engine first.")
        for chunk in receive_chunks(self.link, update_info.metas(), self.chunk_bytes):
            self.model.load_weights([(name, tensor.to(self.device)) for name, tensor in chunk])

    def shutdown(self) -> None:
        self.link = None  # the trainer hosts the store; dropping our side closes the group


__all__ = ["GlooWeightTransferEngine", "GlooWeightTransferInitInfo", "GlooWeightTransferUpdateInfo"]
