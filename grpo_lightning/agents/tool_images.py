"""Tool results with images for a vision-language policy (the policy's tokenizer has a
``processor``): the tool turn is rendered *with* its images and the rollout's image inputs grow.

The tool-turn ids come from the processor (:meth:`~grpo_lightning.tools.templates.ToolTurnTemplate.tool_turn_with_images`:
the chat template renders an image placeholder per image block, the processor expands it to the
model's image tokens). The images' processor outputs are appended after the row's earlier ones
(the prompt's, then earlier tool turns'), the order of the image tokens in the sequence, so the
next turn's generation and every log-prob pass see prompt + completion with all their pixels.

Supported: processors whose image outputs are flat per image, concatenated along dim 0 across
images (the Qwen-VL family: ``pixel_values`` ``(patches, D)`` along patches, ``image_grid_thw``
``(images, 3)`` along images), plus outputs aligned with the tokens (``mm_token_type_ids``: the
tool turn's slice goes at its place in the completion, generated tokens get zeros). Others
(batch-first outputs such as Idefics3's) are refused with a clear error when a tool first returns
an image.

Layer L3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from grpo_lightning.errors import ConfigError
from grpo_lightning.tools.templates import ToolTurnTemplate
from grpo_lightning.types import RowInputs

#: The output that marks a processor whose image inputs concatenate along dim 0 (Qwen-VL).
_FLAT_IMAGE_MARKER = "image_grid_thw"


class ContextPrompt(list):
    """Token ids (``list[int]``) with the image inputs of the images among them, in the per-row
    form :func:`~grpo_lightning.samplers.hf_common.image_inputs` reads (``model_inputs``, token
    fields over all the ids: ``token_fields``), and the raw ``images`` in the order of their
    tokens (what the vLLM samplers send, for the engine's processor to expand), like a dataset's
    image prompt."""

    def __init__(self, ids: Sequence[int], model_inputs: dict[str, torch.Tensor], token_fields: tuple[str, ...] = (),
                 images: Sequence[Any] = ()):
        super().__init__(ids)
        self.model_inputs = model_inputs
        self.token_fields = token_fields
        self.images = list(images)


@dataclass
class ImageTurn:
    """A tool turn rendered with its images: ``ids`` (L,), the images' ``inputs`` (Qwen-VL:
    ``pixel_values`` ``(patches, D)``, ``image_grid_thw`` ``(images, 3)``) and the token-aligned
    outputs over ``ids`` (``tokens``: name -> ``(L,)``)."""

    ids: list[int]
    inputs: dict[str, torch.Tensor]
    tokens: dict[str, torch.Tensor]


@dataclass
class RowImages:
    """A row's image inputs while its episode grows.

    Attributes:
        inputs: The per-image outputs, images in the order of their image tokens (dim 0).
        prompt_tokens: The token-aligned outputs over the prompt, name -> ``(Lp,)``.
        segments: The token-aligned outputs of the tool turns with images: (offset in the
            completion, name -> ``(L,)``); the completion's other tokens get zeros.
        images: The prompt's images (PIL), for the completion table.
    """

    inputs: dict[str, torch.Tensor]
    prompt_tokens: dict[str, torch.Tensor] = field(default_factory=dict)
    segments: list[tuple[int, dict[str, torch.Tensor]]] = field(default_factory=list)
    images: list[Any] = field(default_factory=list)

    @classmethod
    def of_prompt(cls, prompt: Sequence[int]) -> "RowImages | None":
        """An image prompt's inputs (a dataset ``MultimodalPrompt``, or a ``ContextPrompt``), else ``None``."""
        inputs = getattr(prompt, "model_inputs", None)
        if not inputs:
            return None
        token_fields = tuple(getattr(prompt, "token_fields", ()))
        return cls({k: v for k, v in inputs.items() if k not in token_fields},
                   {k: v for k, v in inputs.items() if k in token_fields}, [], list(getattr(prompt, "images", None) or []))

    @classmethod
    def empty(cls, like: "RowImages", prompt_length: int) -> "RowImages":
        """No images, in the fields of ``like``: what a row without images contributes to a batch
        whose other rows have some (Qwen-VL concatenates the images of all rows)."""
        return cls({k: v.new_zeros((0, *v.shape[1:])) for k, v in like.inputs.items()},
                   {k: v.new_zeros(prompt_length) for k, v in like.prompt_tokens.items()})

    @property
    def token_fields(self) -> tuple[str, ...]:
        return tuple(self.prompt_tokens)

    def add(self, turn: ImageTurn, offset: int) -> None:
        """Append a tool turn's images; ``offset``: where its ids start in the completion.

        Raises:
            ValueError: When the turn's outputs differ from the row's earlier ones in their fields.
        """
        if sorted(turn.inputs) != sorted(self.inputs) or sorted(turn.tokens) != sorted(self.prompt_tokens):
            raise ValueError(f"a tool turn's image inputs {sorted({**turn.inputs, **turn.tokens})} differ from the "
                             f"row's earlier ones {sorted({**self.inputs, **self.prompt_tokens})}.")
        self.inputs = {k: torch.cat([v, turn.inputs[k].to(v.device)]) for k, v in self.inputs.items()}
        self.segments.append((offset, turn.tokens))

    @classmethod
    def start(cls, turn: ImageTurn, offset: int, prompt_length: int) -> "RowImages":
        """A text prompt's row whose first tool turn with images starts at ``offset``."""
        row = cls({k: v.new_zeros((0, *v.shape[1:])) for k, v in turn.inputs.items()},
                  {k: v.new_zeros(prompt_length) for k, v in turn.tokens.items()})
        row.add(turn, offset)
        return row

    def completion_tokens(self, length: int) -> dict[str, torch.Tensor]:
        """The token-aligned outputs over the completion's first ``length`` tokens, name -> ``(length,)``."""
        out = {k: v.new_zeros(length) for k, v in self.prompt_tokens.items()}
        for offset, tokens in self.segments:
            for name, values in tokens.items():
                n = max(0, min(values.shape[0], length - offset))
                out[name][offset : offset + n] = values[:n]
        return out

    def context(self, prompt_ids: list[int], completion_ids: list[int], images: Sequence[Any] = ()) -> ContextPrompt:
        """Prompt + completion so far as one generation prompt with every image's inputs and the
        raw ``images`` (prompt's, then the tool turns', as their tokens come)."""
        completion = self.completion_tokens(len(completion_ids))
        tokens = {k: torch.cat([v, completion[k]]) for k, v in self.prompt_tokens.items()}
        return ContextPrompt(prompt_ids + completion_ids, {**self.inputs, **tokens}, self.token_fields, images)

    def row_inputs(self, completion_length: int) -> RowInputs:
        """The rollout's one-row :class:`~grpo_lightning.types.RowInputs` (token fields over the
        prompt in ``rows``, over the completion in ``completion_rows``)."""
        completion = self.completion_tokens(completion_length)
        return RowInputs({k: [v] for k, v in {**self.inputs, **self.prompt_tokens}.items()}, self.token_fields,
                         {k: [v] for k, v in completion.items()})


def image_tool_turn(template: ToolTurnTemplate, processor: Any, tool_messages: Sequence[Mapping[str, Any]],
                    call_names: Sequence[str]) -> ImageTurn:
    """The tool turn rendered with its images (see :class:`ImageTurn`).

    Raises:
        ConfigError: When the processor's image outputs are not the flat per-image kind.
    """
    ids, outputs = template.tool_turn_with_images(tool_messages, call_names, processor)
    tensors = {k: v for k, v in outputs.items() if isinstance(v, torch.Tensor)}
    rendered = tensors.pop("input_ids")  # (1, L_after): the probe rendering, the tool turn is its tail
    tokens = {k: v[0, rendered.shape[1] - len(ids):] for k, v in tensors.items() if v.shape == rendered.shape}
    inputs = {k: v for k, v in tensors.items() if k not in tokens}
    if _FLAT_IMAGE_MARKER not in inputs:
        raise ConfigError(
            f"a tool returned images, and the policy's processor {type(processor).__name__} gives "
            f"{sorted(tensors)}: images in tool turns are supported for processors with flat per-image outputs "
            "concatenated along images (the Qwen-VL family: pixel_values + image_grid_thw). Return the result as text "
            "(a tool returning a string), or use a Qwen-VL policy."
        )
    return ImageTurn(ids, inputs, tokens)


__all__ = ["ContextPrompt", "ImageTurn", "RowImages", "image_tool_turn"]
