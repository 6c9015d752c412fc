"""Tool results with images for a vision-language policy (the policy's tokenizer has a
``processor``): the tool turn is rendered *with* its images and the rollout's image inputs grow.

The tool-turn ids come from the processor (:meth:`~grpo_lightning.tools.templates.ToolTurnTemplate.tool_turn_with_images`:
the chat template renders an image placeholder per image block, the processor expands it to the
model's image tokens). The images' processor outputs are appended after the row's earlier ones
(the prompt's, then earlier tool turns'), the order of the image tokens in the sequence, so the
next turn's generation and every log-prob pass see prompt + completion with all their pixels.

Supported image layouts (:func:`image_layout`), each tested on a tiny model of its family:

* ``grid`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): ``pixel_values`` ``(patches, D)`` concatenated along
  patches, ``image_grid_thw`` ``(images, 3)`` along images;
* ``per_image`` (Gemma3, LLaVA-NeXT, LLaVA, Pixtral): ``pixel_values`` ``(images, ...)`` and
  ``image_sizes`` ``(images, 2)`` along images, trailing dims zero-padded to the larger image
  (LLaVA-NeXT's tiles: the model keeps ``image_sizes``' count of them);
* ``batch_first`` (Idefics3, SmolVLM, Idefics2): ``pixel_values`` ``(1, images, 3, H, W)`` and
  ``pixel_attention_mask`` ``(1, images, H, W)`` along dim 1, zero-padded (the model drops
  all-zero images, as it does for a batch's padding);

plus outputs aligned with the tokens (``mm_token_type_ids``, Gemma3's ``token_type_ids``: the
tool turn's slice goes at its place in the completion, generated tokens get zeros). Processors
with other outputs (Mllama's tiles and cross-attention mask, ...) are refused with a clear error
when a tool first returns an image.

Layer L3.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from grpo_lightning.errors import ConfigError
from grpo_lightning.tools.templates import ToolTurnTemplate, image_blocks
from grpo_lightning.types import RowInputs

#: The outputs of each supported layout: (the output that marks it, every output it may have).
LAYOUTS: dict[str, tuple[str, frozenset[str]]] = {
    "grid": ("image_grid_thw", frozenset()),  # Qwen-VL: any further outputs follow the grid's rule
    "batch_first": ("pixel_attention_mask", frozenset({"pixel_values", "pixel_attention_mask"})),
    "per_image": ("pixel_values", frozenset({"pixel_values", "image_sizes"})),
}


def image_layout(fields: Sequence[str]) -> str:
    """The layout of a processor's image outputs named ``fields`` (token-aligned ones excluded):
    ``grid``, ``batch_first`` or ``per_image`` (see the module docstring)."""
    return next((name for name, (marker, _) in LAYOUTS.items() if marker in fields), "per_image")


def image_axis(fields: Sequence[str]) -> int:
    """The dim along which the images of a row's outputs named ``fields`` follow each other."""
    return 1 if image_layout(fields) == "batch_first" else 0


def append_images(earlier: torch.Tensor, later: torch.Tensor, axis: int) -> torch.Tensor:
    """``earlier`` then ``later`` along ``axis``, the dims after it zero-padded to the larger."""
    shape = [max(a, b) for a, b in zip(earlier.shape[axis + 1:], later.shape[axis + 1:])]
    parts = []
    for part in (earlier, later.to(earlier.device)):
        if list(part.shape[axis + 1:]) != shape:
            grown = part.new_zeros((*part.shape[: axis + 1], *shape))
            grown[(*(slice(None),) * (axis + 1), *(slice(0, n) for n in part.shape[axis + 1:]))] = part
            part = grown
        parts.append(part)
    return torch.cat(parts, dim=axis)


def no_images(like: torch.Tensor, axis: int) -> torch.Tensor:
    """``like``'s field holding no image: ``(0, ...)`` along dim 0, ``(1, 0, ...)`` batch-first."""
    return like.new_zeros((*like.shape[:axis], 0, *like.shape[axis + 1:]))


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
        inputs: The image outputs, images in the order of their image tokens (along
            :func:`image_axis`: dim 0, or dim 1 for batch-first processors).
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
        whose other rows have some (the batch concatenates the images of all rows)."""
        axis = image_axis(list(like.inputs))
        return cls({k: no_images(v, axis) for k, v in like.inputs.items()},
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
        axis = image_axis(list(self.inputs))
        self.inputs = {k: append_images(v, turn.inputs[k], axis) for k, v in self.inputs.items()}
        self.segments.append((offset, turn.tokens))

    @classmethod
    def start(cls, turn: ImageTurn, offset: int, prompt_length: int) -> "RowImages":
        """A text prompt's row whose first tool turn with images starts at ``offset``."""
        axis = image_axis(list(turn.inputs))
        row = cls({k: no_images(v, axis) for k, v in turn.inputs.items()},
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
        ConfigError: When the processor's image outputs are of none of the supported layouts.
    """
    num_images = sum(len(image_blocks(m.get("content"))) for m in tool_messages)
    ids, outputs = template.tool_turn_with_images(tool_messages, call_names, processor)
    tensors = {k: v for k, v in outputs.items() if isinstance(v, torch.Tensor)}
    rendered = tensors.pop("input_ids")  # (1, L_after): the probe rendering, the tool turn is its tail
    tokens = {k: v[0, rendered.shape[1] - len(ids):] for k, v in tensors.items() if v.shape == rendered.shape}
    inputs = {k: v for k, v in tensors.items() if k not in tokens}
    if not _known_layout(inputs, num_images):
        raise ConfigError(
            f"a tool returned {num_images} image(s), and the policy's processor {type(processor).__name__} gives "
            f"{ {k: tuple(v.shape) for k, v in inputs.items()} }: images in tool turns are supported for the image "
            "outputs of Qwen-VL (pixel_values + image_grid_thw), Gemma3/LLaVA(-NeXT) (pixel_values [+ image_sizes] "
            "per image) and Idefics3/SmolVLM (pixel_values + pixel_attention_mask). Return the result as text "
            "(a tool returning a string), or use a policy of one of those families."
        )
    return ImageTurn(ids, inputs, tokens)


def _known_layout(inputs: Mapping[str, torch.Tensor], num_images: int) -> bool:
    """Whether ``inputs`` (one tool turn's image outputs) are of a supported layout, their image
    dim holding ``num_images`` images."""
    layout = image_layout(list(inputs))
    marker, allowed = LAYOUTS[layout]
    if marker not in inputs or (allowed and not set(inputs) <= allowed):
        return False
    if layout == "grid":
        return inputs[marker].shape[0] == num_images
    axis = image_axis(list(inputs))
    return all(v.dim() > axis and tuple(v.shape[: axis + 1]) == (*(1,) * axis, num_images) for v in inputs.values())


__all__ = ["ContextPrompt", "ImageTurn", "LAYOUTS", "RowImages", "append_images", "image_axis", "image_layout",
           "image_tool_turn", "no_images"]
