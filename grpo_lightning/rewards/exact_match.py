"""Exact-match reward: 1.0 when the completion equals the reference answer, else 0.0.

Pure python (no torch, no lightning).
"""

from __future__ import annotations

from typing import Any, Sequence


def _completion_text(completion: Any) -> str:
    """The text of one completion: a string, or the last message's ``content`` of a conversation."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, dict):  # a single message
        return str(completion.get("content") or "")
    if isinstance(completion, Sequence):  # conversational: [{"role": ..., "content": ...}, ...]
        if not completion:
            return ""
        return _completion_text(completion[-1])
    raise TypeError(
        f"unsupported completion type {type(completion).__name__}: "
        "expected a str or a list of messages"
    )


def exact_match_reward(
    completions: Sequence[Any], answer: Sequence[Any], **kwargs: Any
) -> list[float]:
    """Score each completion 1.0 if its stripped text equals ``str(answer).strip()``, else 0.0.

    Follows the TRL reward-function convention: dataset columns arrive as keyword arguments, one
    value per completion, so a dataset with an ``answer`` column feeds ``answer`` here.

    Args:
        completions: One entry per completion: a string, or for conversational completions a list
            of ``{"role", "content"}`` messages whose last message's ``content`` is compared.
        answer: The reference answers, aligned with ``completions`` (any type; compared via
            ``str``).
        **kwargs: Other dataset columns and trainer state; ignored.

    Returns:
        A list of floats, 1.0 or 0.0, the same length as ``completions``.

    Raises:
        ValueError: If ``completions`` and ``answer`` differ in length.

    Example:
        >>> exact_match_reward(["64", " 64\\n", "65", ""], ["64", "64", "64", "64"])
        [1.0, 1.0, 0.0, 0.0]
        >>> exact_match_reward([[{"role": "assistant", "content": "42 "}]], [42])
        [1.0]
    """
    if len(completions) != len(answer):
        raise ValueError(
            f"exact_match_reward got {len(completions)} completions but {len(answer)} answers: "
            "pass one answer per completion."
        )
    return [
        1.0 if _completion_text(c).strip() == str(a).strip() else 0.0
        for c, a in zip(completions, answer)
    ]
