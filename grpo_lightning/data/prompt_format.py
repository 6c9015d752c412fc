"""Prompt → token ids, and completion ids → what reward functions receive (TRL semantics).

No lightning here: these are helpers the Lightning datamodule uses.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from grpo_lightning.data.sources import is_conversational


def _has_chat_template(tokenizer: Any) -> bool:
    return getattr(tokenizer, "chat_template", None) is not None


def format_row(row: dict[str, Any], prompt_as_chat: bool, system_prompt: str | None) -> dict[str, Any]:
    """``row`` with its prompt as the model will see it: a text prompt wrapped as a user turn when
    ``prompt_as_chat``, and ``system_prompt`` put first in a conversation that has none.

    >>> format_row({"prompt": "hi", "answer": 1}, True, "be brief")["prompt"]
    [{'role': 'system', 'content': 'be brief'}, {'role': 'user', 'content': 'hi'}]
    """
    prompt = row["prompt"]
    if prompt_as_chat and isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if system_prompt is not None and isinstance(prompt, list) and prompt[0].get("role") != "system":
        prompt = [{"role": "system", "content": system_prompt}, *prompt]
    return {**row, "prompt": prompt}


def check_system_prompt(system_prompt: str | None, prompt_as_chat: bool, datasets: Sequence[Any]) -> None:
    """Refuse a ``system_prompt`` that no prompt would get: the first row of a set is plain text and
    ``prompt_as_chat`` is off (a system message goes into conversations only)."""
    if system_prompt is None or prompt_as_chat:
        return
    for dataset in datasets:
        if dataset is not None and len(dataset) and isinstance(dataset[0]["prompt"], str):
            raise ValueError(
                "data.system_prompt is set but the prompts are plain text, which have no place for a system "
                "message: set data.prompt_as_chat: true to send each as a user turn after it (the model's "
                "chat template is then applied), or put the instruction into the prompt text."
            )


def tokenize_prompt(
    prompt: str | Sequence[Mapping[str, Any]],
    tokenizer: Any,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Token ids of one prompt, as TRL's GRPO trainer builds them.

    A string is tokenized as is, with the tokenizer's default special tokens (TRL adds no
    truncation). A conversation (list of role/content messages) is rendered with the chat
    template and the generation prompt (``add_generation_prompt=True``); when its last message is
    from the assistant, that message is continued instead (``continue_final_message=True``, no
    generation prompt), so a prefilled answer start is extended.

    Args:
        prompt: A string or a list of ``{"role", "content"}`` messages.
        tokenizer: A Hugging Face tokenizer (``PreTrainedTokenizerBase``).
        chat_template_kwargs: Extra keyword arguments for ``apply_chat_template`` (e.g.
            ``{"enable_thinking": False}``, ``tools``); they override the defaults above.

    Returns:
        The prompt's token ids.

    Raises:
        ValueError: A conversational prompt with a tokenizer that has no chat template, or a
            prompt that is neither a string nor a message list.
    """
    if isinstance(prompt, str):
        return list(tokenizer(prompt)["input_ids"])
    if not is_conversational(prompt):
        raise ValueError(
            f"prompt {prompt!r:.200} is neither a string nor a list of "
            '{"role": ..., "content": ...} messages; fix the dataset\'s prompt column.'
        )
    if not _has_chat_template(tokenizer):
        raise ValueError(
            "the prompts are conversations (lists of role/content messages) but the tokenizer "
            f"{type(tokenizer).__name__} has no chat template. Use a tokenizer that has one (an "
            "instruct/chat model), set tokenizer.chat_template, or turn the prompts into plain "
            "strings."
        )
    continue_final = prompt[-1].get("role") == "assistant"
    kwargs: dict[str, Any] = {
        "add_generation_prompt": not continue_final,
        "continue_final_message": continue_final,
        "tokenize": True,
        "return_dict": False,
    }
    kwargs.update(chat_template_kwargs or {})
    ids = tokenizer.apply_chat_template(list(prompt), **kwargs)
    if isinstance(ids, Mapping):  # a caller forced return_dict=True
        ids = ids["input_ids"]
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if ids and isinstance(ids[0], list):  # some processors return a batch of one
        ids = ids[0]
    return list(ids)


def check_completion_fits(max_completion_length: int, max_context_length: int | None) -> None:
    """Raise at start-up when no prompt could fit: ``max_completion_length`` alone fills the context.

    >>> check_completion_fits(512, 2048)
    >>> check_completion_fits(4096, 2048)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: data.generation.max_completion_length=4096 leaves no room for a prompt ...
    """
    if max_context_length and max_completion_length >= max_context_length:
        raise ValueError(
            f"data.generation.max_completion_length={max_completion_length} leaves no room for a prompt in the "
            f"model's context of {max_context_length} tokens (max_position_embeddings). Lower it below "
            f"{max_context_length}, by at least the longest prompt's length."
        )


def check_context_length(
    prompt_ids: Sequence[Sequence[int]],
    row_ids: Sequence[int],
    max_completion_length: int,
    max_context_length: int | None,
    counted: str = "",
) -> None:
    """Raise when a prompt plus ``max_completion_length`` tokens exceeds the model's context.

    ``prompt_ids`` are the prompts exactly as the sampler receives them: a vision-language row's
    ids hold every image token the processor expanded (a 448x448 image is ~256 of Qwen2-VL's), an
    agent row's the tool schemas. Generating past the context length only earns a transformers
    warning and then garbage (or an index error deep inside the model), so it is an error here.

    Args:
        prompt_ids: One prompt's ids per entry.
        row_ids: The dataset row of each entry (named in the error).
        max_completion_length: ``data.generation.max_completion_length``.
        max_context_length: The model's context (``max_position_embeddings``); ``None`` skips the check.
        counted: What the lengths hold beyond the text, for the message (e.g. " with its tools");
            prompts that carry images (``.images``) add ", image tokens included".

    Raises:
        ValueError: Naming the first rows that do not fit, their lengths and the fixes.

    >>> check_context_length([[1, 2, 3]], [0], max_completion_length=5, max_context_length=8)
    >>> check_context_length([[1, 2, 3, 4]], [9], max_completion_length=5, max_context_length=8)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: 1 prompt(s) are too long for the model: row 9 (4 tokens); ...
    """
    if not max_context_length:
        return
    budget = max_context_length - max_completion_length
    too_long: dict[int, int] = {}
    for ids, row in zip(prompt_ids, row_ids):
        if len(ids) > budget and row not in too_long:
            too_long[row] = len(ids)
    if not too_long:
        return
    if any(getattr(ids, "images", None) for ids in prompt_ids):  # MultimodalPrompt / ContextPrompt
        counted += ", image tokens included"
    shown = ", ".join(f"row {row} ({length} tokens{counted})" for row, length in list(too_long.items())[:5])
    longest = max(too_long.values())
    fix = (
        f"lower data.generation.max_completion_length to at most {max_context_length - longest}, or filter "
        if longest < max_context_length
        else "filter "
    )
    raise ValueError(
        f"{len(too_long)} prompt(s) are too long for the model: {shown}; with "
        f"data.generation.max_completion_length={max_completion_length} they exceed the model's context of "
        f"{max_context_length} tokens (max_position_embeddings). Fix: {fix}the dataset's long prompts out "
        "(e.g. dataset.filter on the prompt length) before training."
    )


def decode_completions(
    completion_ids: Sequence[Sequence[int]], tokenizer: Any, conversational: bool
) -> list[Any]:
    """Decode completions into what reward functions receive as ``completions``.

    Args:
        completion_ids: Unpadded completion token lists.
        tokenizer: The policy's tokenizer.
        conversational: Whether the prompts were conversations.

    Returns:
        Strings (special tokens skipped) or, for conversational prompts, one
        ``[{"role": "assistant", "content": text}]`` list per completion (TRL's plain case, without
        tool-call parsing).
    """
    texts = tokenizer.batch_decode([list(ids) for ids in completion_ids], skip_special_tokens=True)
    if conversational:
        return [[{"role": "assistant", "content": text}] for text in texts]
    return list(texts)
