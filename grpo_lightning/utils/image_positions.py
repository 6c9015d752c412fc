"""Position ids of vision-language models that derive them from the images (Qwen-VL's M-RoPE).

Such a model computes the 3-D (temporal, height, width) positions of a prompt with images itself,
from its image grids (``get_rope_index``); the text tokens after the images continue from the
largest of them. A decode loop that runs the prefill through the model and then feeds one token
at a time needs, per row, where the positions stand after the prefill: :func:`prefill_positions`
records what the model handed its language model, whichever transformers version computed it.

Layer L0.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch


def core_model(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` without a DDP (``.module``) or PEFT wrapper."""
    core = getattr(model, "module", model)
    if type(core).__module__.split(".")[0] == "peft" and callable(getattr(core, "get_base_model", None)):
        core = core.get_base_model()
    return core


def computes_own_positions(model: torch.nn.Module) -> bool:
    """Whether the model derives its position ids from the images itself (Qwen-VL's M-RoPE,
    ``get_rope_index``): then none are passed with images; otherwise they follow the attention mask."""
    core = core_model(model)
    return any(callable(getattr(m, "get_rope_index", None)) for m in (core, getattr(core, "model", None)) if m is not None)


class RecordedPositions:
    """The ``position_ids`` of the last call of a language model (``None`` before one)."""

    value: torch.Tensor | None = None

    def last_positions(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """Each row's largest position over its real tokens, ``(3, R, 1)`` for the 3 M-RoPE axes:
        the next token takes this plus one on every axis.

        Args:
            attention_mask: ``(R, L)`` of the recorded call (0 on left padding).
        """
        if self.value is None:
            raise RuntimeError("the model's language model was not called with position_ids during the prefill.")
        axes = self.value[-3:] if self.value.dim() == 3 else self.value.reshape(1, *self.value.shape).expand(3, -1, -1)
        real = attention_mask.to(axes.device).bool()[None]  # (1, R, L)
        return axes.masked_fill(~real, torch.iinfo(axes.dtype).min).amax(-1, keepdim=True)  # (3, R, 1)


@contextmanager
def prefill_positions(model: torch.nn.Module) -> Iterator[RecordedPositions]:
    """Record the ``position_ids`` ``model`` gives its language model (``get_decoder()``) while
    the context is open: ``(3, R, L)``, or ``(4, R, L)`` with the text positions first."""
    recorded = RecordedPositions()
    decoder = core_model(model).get_decoder()

    def record(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        if kwargs.get("position_ids") is not None:
            recorded.value = kwargs["position_ids"]

    hook = decoder.register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield recorded
    finally:
        hook.remove()


__all__ = ["RecordedPositions", "computes_own_positions", "core_model", "prefill_positions"]
