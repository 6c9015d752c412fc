"""Image prompts: dataset ``image`` / ``images`` columns → the processor → ids plus per-row inputs.

A row with images is encoded by the model's processor (``processing_class`` a processor, e.g.
``Qwen2VLProcessor``): a conversational prompt becomes multimodal messages (one ``{"type":
"image"}`` part per image, first in the first user message, unless the messages already hold
image parts), the chat template renders them, and the processor expands the image tokens and
computes the pixel inputs. The result is a :class:`MultimodalPrompt`: the prompt's token ids (a
``list[int]``, so every text-only path keeps working) carrying the processor's other outputs,
which follow each completion of the prompt into the :class:`~grpo_lightning.types.RolloutBatch`
(:class:`~grpo_lightning.types.RowInputs`) and into every forward.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from grpo_lightning.data.prompt_format import tokenize_prompt
from grpo_lightning.types import Rollout, RowInputs
from grpo_lightning.utils.processor_outputs import split_processor_outputs

#: Dataset columns that hold a row's images (TRL: ``image`` one image, ``images`` a list).
IMAGE_COLUMNS = ("image", "images")


class MultimodalPrompt(list):
    """A prompt's token ids (``list[int]``) with the processor's other outputs for it.

    ``model_inputs`` is in the per-row form of :class:`~grpo_lightning.types.RowInputs` (token
    fields as ``(Lp,)``); ``token_fields`` names those; ``images`` are the row's images.
    """

    def __init__(self, ids: Sequence[int], model_inputs: dict[str, torch.Tensor], token_fields: tuple[str, ...],
                 images: list[Any]) -> None:
        super().__init__(ids)
        self.model_inputs = model_inputs
        self.token_fields = token_fields
        self.images = images


def processor_of(tokenizer: Any) -> Any | None:
    """The multimodal processor behind the policy's tokenizer (``load_tokenizer`` attaches it as
    ``tokenizer.processor`` when ``processing_class`` is a processor), or ``None``."""
    return getattr(tokenizer, "processor", None)


def row_images(row: Mapping[str, Any], row_id: int) -> list[Any] | None:
    """The row's images as PIL images (paths are opened, converted to RGB), or ``None`` when the
    row has no ``image`` / ``images`` column (or it is empty)."""
    if "image" in row and "images" in row:
        raise ValueError(f"dataset row {row_id} has both an 'image' and an 'images' column: keep one.")
    value = row.get("image", row.get("images"))
    if value is None:
        return None
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    return [_as_image(v, row_id) for v in values] or None


def _as_image(value: Any, row_id: int) -> Any:
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.convert("RGB") if value.mode != "RGB" else value
    if isinstance(value, str):
        try:
            return Image.open(value).convert("RGB")
        except OSError as e:
            raise ValueError(f"dataset row {row_id}: cannot open image {value!r} ({e}).") from e
    if isinstance(value, Mapping) and value.get("path"):  # datasets' Image feature without decoding
        return _as_image(value["path"], row_id)
    raise ValueError(
        f"dataset row {row_id}: an image is a {type(value).__name__}; give PIL images or file paths in the "
        "'image' / 'images' column."
    )


def _count_image_parts(messages: Sequence[Mapping[str, Any]]) -> int:
    return sum(
        1 for m in messages if isinstance(m.get("content"), list)
        for part in m["content"] if isinstance(part, Mapping) and part.get("type") == "image"
    )


def multimodal_messages(prompt: Sequence[Mapping[str, Any]], num_images: int, row_id: int) -> list[dict[str, Any]]:
    """``prompt`` with content-part lists: string contents become ``[{"type": "text", ...}]`` and,
    unless the messages already hold image parts, ``num_images`` ``{"type": "image"}`` parts open
    the first user message (TRL's ``prepare_multimodal_messages``). Raises when the image parts
    and the row's images disagree in number.

    >>> multimodal_messages([{"role": "user", "content": "hi"}], 1, 0)[0]["content"]
    [{'type': 'image'}, {'type': 'text', 'text': 'hi'}]
    """
    existing = _count_image_parts(prompt)
    if existing and existing != num_images:
        raise ValueError(
            f"dataset row {row_id}: its prompt has {existing} image part(s) but the row has {num_images} "
            "image(s); make the 'image'/'images' column and the prompt's {'type': 'image'} parts agree."
        )
    out, placed = [], bool(existing)
    for message in prompt:
        content = message.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        if not placed and message.get("role") == "user":
            parts = [{"type": "image"} for _ in range(num_images)] + parts
            placed = True
        out.append({**message, "content": parts})
    if not placed:
        raise ValueError(f"dataset row {row_id}: a prompt with images needs a user message to put them in.")
    return out


def encode_multimodal_prompt(
    prompt: str | Sequence[Mapping[str, Any]], images: list[Any], processor: Any, row_id: int,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> MultimodalPrompt:
    """Apply the processor to one prompt and its images (see the module docstring)."""
    if isinstance(prompt, str):
        text = prompt
        token = getattr(processor, "image_token", None)
        found = text.count(token) if token else len(images)
        if found != len(images):
            raise ValueError(
                f"dataset row {row_id}: its text prompt holds {found} image token(s) {token!r} but the row has "
                f"{len(images)} image(s); put one {token!r} per image in the prompt, or use a conversational prompt."
            )
    else:
        messages = multimodal_messages(prompt, len(images), row_id)
        continue_final = messages[-1].get("role") == "assistant"
        kwargs: dict[str, Any] = {"add_generation_prompt": not continue_final,
                                  "continue_final_message": continue_final, "tokenize": False}
        kwargs.update(chat_template_kwargs or {})
        text = processor.apply_chat_template(messages, **kwargs)
    ids, inputs, token_fields = split_processor_outputs(processor(text=[text], images=[images], return_tensors="pt"))
    return MultimodalPrompt(ids, inputs, token_fields, images)


def encode_row_prompt(
    row: Mapping[str, Any], row_id: int, tokenizer: Any, chat_template_kwargs: Mapping[str, Any] | None = None
) -> list[int]:
    """The ids the sampler receives for ``row``: a :class:`MultimodalPrompt` when the row has
    images, else :func:`~grpo_lightning.data.prompt_format.tokenize_prompt`'s ids."""
    images = row_images(row, row_id)
    if images is None:
        return tokenize_prompt(row["prompt"], tokenizer, chat_template_kwargs)
    processor = processor_of(tokenizer)
    if processor is None:
        raise ValueError(
            f"dataset row {row_id} has images but the policy's processing class is a plain tokenizer: set "
            "model.tokenizer to the model's processor (a folder with preprocessor_config.json, or a processor "
            "object) to train a vision-language model, or drop the 'image'/'images' column."
        )
    return encode_multimodal_prompt(row["prompt"], images, processor, row_id, chat_template_kwargs)


def check_sampler_images(sampler: Any, prompts: Sequence[Any]) -> None:
    """Refuse a sampler that cannot take images before it drops them silently."""
    if any(isinstance(p, MultimodalPrompt) for p in prompts) and not getattr(sampler, "supports_images", False):
        raise ValueError(
            f"the prompts have images but the sampler {type(sampler).__name__} does not take image inputs; "
            "use data.sampler: hf_generate, fast_generate, vllm_colocate or vllm_server for vision-language models."
        )


def attach_model_inputs(rollouts: list[Rollout], prompts: Sequence[Any], num_generations: int) -> list[Rollout]:
    """Give rollout ``i`` (the ``i % G``-th completion of ``prompts[i // G]``) its own one-row
    :class:`~grpo_lightning.types.RowInputs` of that prompt's model inputs."""
    for i, rollout in enumerate(rollouts):
        prompt = prompts[i // num_generations]
        if isinstance(prompt, MultimodalPrompt):
            rollout.model_inputs = RowInputs({k: [v] for k, v in prompt.model_inputs.items()}, prompt.token_fields)
            rollout.images = list(prompt.images)
    return rollouts


def row_inputs_of(rollouts: Sequence[Rollout]) -> RowInputs | None:
    """The batch's :class:`~grpo_lightning.types.RowInputs` (``None`` when no row has any).

    Rows must agree on the fields: a batch mixing image and text-only prompts is refused (the
    model would receive pixel inputs for some rows only, which the processors do not define)."""
    with_inputs = [r.model_inputs is not None for r in rollouts]
    if not any(with_inputs):
        return None
    if not all(with_inputs):
        row = with_inputs.index(False)
        raise ValueError(
            f"row {row} of a generation batch has no image while others have: every prompt of a vision-language "
            "run needs at least one image (filter the text-only rows out, or give them an image)."
        )
    first = rollouts[0].model_inputs
    names = sorted(first.rows)
    for i, r in enumerate(rollouts):
        if sorted(r.model_inputs.rows) != names:
            raise ValueError(f"row {i} has model inputs {sorted(r.model_inputs.rows)}, row 0 has {names}.")
    completion = {n: [r.model_inputs.completion_rows.get(n, [v.new_zeros(0) for v in r.model_inputs.rows[n]])
                      for r in rollouts] for n in first.token_fields if any(r.model_inputs.completion_rows for r in rollouts)}
    return RowInputs({n: [v for r in rollouts for v in r.model_inputs.rows[n]] for n in names}, first.token_fields,
                     {n: [v for values in per_row for v in values] for n, per_row in completion.items()})


def image_column(rollouts: Sequence[Rollout]) -> list[Any] | None:
    """The completion table's ``image`` column: each row's first image (``None`` when the batch
    has no images). MLflow stores PIL images of a table as image artifacts."""
    if not any(r.images for r in rollouts):
        return None
    return [r.images[0] if r.images else None for r in rollouts]
