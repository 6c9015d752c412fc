"""Splitting a multimodal processor's output for one prompt into its parts (layer L0).

A processor (``Qwen2VLProcessor``, ``Gemma3Processor``, ...) called on one text and its images
returns ``input_ids`` and ``attention_mask`` ``(1, L)``, tensors aligned with the tokens (Qwen's
``mm_token_type_ids``, Gemma3's ``token_type_ids``: ``(1, L)``) and the image tensors (pixel
values, grids, sizes: any shape). The data side's image prompts and the weight probe's image
sequence both keep them in the per-row form of :class:`~grpo_lightning.types.RowInputs`.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

#: Processor outputs a batch already has as prompt ids / mask.
TEXT_FIELDS = ("input_ids", "attention_mask")


def split_processor_outputs(encoded: Mapping[str, Any]) -> tuple[list[int], dict[str, torch.Tensor], tuple[str, ...]]:
    """``(ids, model_inputs, token_fields)`` of a one-prompt processor output: the ids as a list,
    the other tensors (token-aligned ones as ``(L,)``), and the names of the token-aligned ones.

    >>> ids, inputs, fields = split_processor_outputs({"input_ids": torch.tensor([[5, 9, 9]]),
    ...     "attention_mask": torch.ones(1, 3), "mm_token_type_ids": torch.tensor([[0, 1, 1]]),
    ...     "pixel_values": torch.zeros(8, 4)})
    >>> ids, fields, inputs["mm_token_type_ids"].tolist(), tuple(inputs["pixel_values"].shape)
    ([5, 9, 9], ('mm_token_type_ids',), [0, 1, 1], (8, 4))
    """
    ids = encoded["input_ids"]  # (1, L)
    inputs: dict[str, torch.Tensor] = {}
    token_fields: list[str] = []
    for name, value in encoded.items():
        if name in TEXT_FIELDS or not isinstance(value, torch.Tensor):
            continue
        if value.shape == ids.shape:  # aligned with the prompt tokens
            inputs[name] = value[0]
            token_fields.append(name)
        else:
            inputs[name] = value
    return ids[0].tolist(), inputs, tuple(token_fields)
