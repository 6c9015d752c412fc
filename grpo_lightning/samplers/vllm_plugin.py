"""Our vLLM plugin (entry point ``vllm.general_plugins``): registers the ``gloo`` weight-transfer
backend in every vLLM process, so ``vllm serve --weight-transfer-config '{"backend": "gloo"}'``
accepts weights from a grpo_lightning trainer without NCCL (see docs/samplers.md).

Layer L2. Registration is lazy (by module path): vLLM imports the engine only when a server is
started with that backend; other vLLM uses pay nothing.
"""

from __future__ import annotations

GLOO_BACKEND = "gloo"


def register() -> None:
    """Register the ``gloo`` backend with vLLM's weight-transfer factory (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    if GLOO_BACKEND in WeightTransferEngineFactory._registry:
        return
    WeightTransferEngineFactory.register_engine(
        GLOO_BACKEND, "grpo_lightning.samplers.vllm_gloo_engine", "GlooWeightTransferEngine")


__all__ = ["GLOO_BACKEND", "register"]
