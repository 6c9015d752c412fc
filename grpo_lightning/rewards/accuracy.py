"""Math-answer rewards checked with ``math_verify`` (TRL's ``trl/rewards/accuracy_rewards.py``).

Needs the ``[math]`` extra (``pip install 'grpo-lightning[math]'``); it is imported on first use.
Pure python, no torch, no lightning.
"""

from __future__ import annotations

import logging
import math
import threading
from typing import Any, Callable, Sequence

from grpo_lightning.rewards.exact_match import _completion_text

_MATH_EXTRA = "pip install 'grpo-lightning[math]'"


def _math_verify() -> Any:
    try:
        import math_verify
        from latex2sympy2_extended import NormalizationConfig
    except ImportError as err:
        raise ImportError(
            f"accuracy rewards check answers with the math-verify package, which is not installed: "
            f"{_MATH_EXTRA} (or pip install math-verify)."
        ) from err
    return math_verify, NormalizationConfig


def _timeouts() -> tuple[int | None, int | None]:
    """TRL's parse/verify timeouts (10 s / 5 s): ``math_verify`` uses ``signal.alarm``, which only
    works on the main thread, so elsewhere (e.g. an async reward loop) timeouts are off."""
    if threading.current_thread() is threading.main_thread():
        return 10, 5
    logging.getLogger("math_verify.parser").setLevel(logging.ERROR)
    logging.getLogger("math_verify.grader").setLevel(logging.ERROR)
    return None, None


def _score(contents: Sequence[str | None], solution: Sequence[Any]) -> tuple[list, list, list]:
    """Rewards and logged parses; a ``None`` content is an incomplete reasoning (0.0)."""
    mv, normalization = _math_verify()
    parsing_timeout, verify_timeout = _timeouts()
    # Boxed answers first; no anchor-less extraction; first match; units normalised (TRL).
    answer_config = [
        mv.LatexExtractionConfig(
            normalization_config=normalization(units=True),
            boxed_match_priority=0,
            try_extract_without_anchor=False,
        )
    ]
    rewards: list[float | None] = []
    gold_strs: list[str] = []
    answer_strs: list[str] = []
    for content, sol in zip(contents, solution, strict=True):
        if content is None:
            rewards.append(0.0)
            gold_strs.append("[incomplete reasoning]")
            answer_strs.append("[incomplete reasoning]")
            continue
        gold = mv.parse(str(sol), parsing_timeout=parsing_timeout)
        if len(gold) == 0:  # unparseable gold: the row is not applicable
            rewards.append(None)
            gold_strs.append("[unparseable]")
            answer_strs.append("[skipped]")
            continue
        answer = mv.parse(
            content, extraction_config=answer_config, extraction_mode="first_match",
            parsing_timeout=parsing_timeout,
        )  # fmt: skip
        rewards.append(float(mv.verify(gold, answer, timeout_seconds=verify_timeout)))
        gold_strs.append(str(gold))
        answer_strs.append(str(answer) if answer else "[unparseable]")
    return rewards, gold_strs, answer_strs


def _log(log_extra: Callable[[str, list], None] | None, solution: Sequence[Any], gold, answer):
    if log_extra is not None:
        log_extra("solution", list(solution))
        log_extra("gold_parsed", gold)
        log_extra("answer_parsed", answer)


def accuracy_reward(
    completions: Sequence[Any],
    solution: Sequence[Any],
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    r"""1.0 when the completion's answer is mathematically equal to the gold solution, else 0.0.

    The gold ``solution`` (a worked solution with ``\boxed{}``, or an answer such as
    ``$\frac{1}{3}$``) is parsed with ``math_verify``; a row whose gold cannot be parsed gets
    ``None`` (not applicable). The completion is parsed with a LaTeX extraction config (``\boxed``
    first, units normalised, no anchor-less extraction, first match) and compared with
    ``math_verify.verify``. Same rule as TRL's ``accuracy_reward``; a completion that is a list of
    messages is read from its last message (TRL reads the first; they agree for one message).

    Args:
        completions: Strings, or conversational completions (lists of messages).
        solution: The gold solutions, one per completion (dataset column ``solution``).
        log_extra: Given by the trainer: logs ``solution``, ``gold_parsed`` and ``answer_parsed``
            columns to the completions table.
        **kwargs: Other dataset columns and trainer state; ignored.

    Returns:
        1.0 / 0.0 per completion, ``None`` where the gold is unparseable.

    Raises:
        ImportError: If ``math-verify`` is missing (``pip install 'grpo-lightning[math]'``).

    Example:
        >>> accuracy_reward([r"So it is \boxed{\frac{1}{3}}.", r"\boxed{0.5}",
        ...                  [{"role": "assistant", "content": r"\boxed{2/6}"}]],
        ...                 [r"$\frac{1}{3}$"] * 3)
        [1.0, 0.0, 1.0]
        >>> accuracy_reward([r"\boxed{1}"], ["no math here"])
        [None]
    """
    contents = [_completion_text(c) for c in completions]
    rewards, gold, answer = _score(contents, solution)
    _log(log_extra, solution, gold, answer)
    return rewards


def reasoning_accuracy_reward(
    completions: Sequence[Any],
    solution: Sequence[Any],
    reasoning_delimiters: Sequence[str] | None = None,
    log_extra: Callable[[str, list], None] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    r""":func:`accuracy_reward` on the text after the reasoning (TRL's
    ``reasoning_accuracy_reward``).

    The answer is the text after the first delimiter (in list order) found in the completion,
    split at its last occurrence; a completion with no delimiter has not finished reasoning and
    scores 0.0 (a penalty, not ``None``).

    Args:
        completions: Strings, or conversational completions (lists of messages).
        solution: The gold solutions, one per completion.
        reasoning_delimiters: Strings that end the reasoning; default ``["</think>"]``.
        log_extra: Given by the trainer: logs ``solution``, ``gold_parsed``, ``answer_parsed``.
        **kwargs: Other dataset columns and trainer state; ignored.

    Returns:
        1.0 / 0.0 per completion, ``None`` where the gold is unparseable.

    Example:
        >>> reasoning_accuracy_reward(
        ...     [r"<think>maybe \boxed{2}</think> The answer is \boxed{3}",
        ...      r"<think>it is \boxed{3} but I am still thinking"], ["$3$", "$3$"])
        [1.0, 0.0]
    """
    delimiters = list(reasoning_delimiters) if reasoning_delimiters is not None else ["</think>"]
    contents: list[str | None] = []
    for completion in completions:
        text = _completion_text(completion)
        delim = next((d for d in delimiters if d in text), None)
        contents.append(None if delim is None else text.split(delim)[-1])
    rewards, gold, answer = _score(contents, solution)
    _log(log_extra, solution, gold, answer)
    return rewards


class CosineScaledReward:
    """Correctness scaled by length on a cosine schedule (TRL's ``get_cosine_scaled_reward``).

    ``p = min(len(completion_ids) / max_len, 1)``; correct answers get
    ``lo + (hi - lo)(1 + cos(p·pi))/2`` with ``(lo, hi) = (min_value_correct, max_value_correct)``
    (shorter is better), wrong ones the same with ``(max_value_wrong, min_value_wrong)`` (shorter
    is punished more); ``None`` where the gold is unparseable. Metric name
    ``cosine_scaled_reward``.

    Args:
        max_len: Length (tokens) at which the schedule ends.
        min_value_wrong: Reward of a wrong completion of length 0.
        max_value_wrong: Reward of a wrong completion of length ``max_len``.
        min_value_correct: Reward of a correct completion of length ``max_len``.
        max_value_correct: Reward of a correct completion of length 0.

    Example:
        >>> reward = CosineScaledReward(max_len=100)
        >>> reward([r"\\boxed{\\frac{1}{3}}", r"\\boxed{\\frac{1}{2}}"], [r"$\\frac{1}{3}$"] * 2,
        ...        [[1] * 50, [1] * 50])
        [0.75, -0.75]
    """

    __name__ = "cosine_scaled_reward"

    def __init__(
        self,
        max_len: int,
        min_value_wrong: float = -1.0,
        max_value_wrong: float = -0.5,
        min_value_correct: float = 0.5,
        max_value_correct: float = 1.0,
    ) -> None:
        if max_len <= 0:
            raise ValueError(f"CosineScaledReward max_len={max_len}: it must be positive.")
        self.max_len = max_len
        self.min_value_wrong, self.max_value_wrong = min_value_wrong, max_value_wrong
        self.min_value_correct, self.max_value_correct = min_value_correct, max_value_correct

    def __call__(
        self,
        completions: Sequence[Any],
        solution: Sequence[Any],
        completion_ids: Sequence[Sequence[int]],
        **kwargs: Any,
    ) -> list[float | None]:
        """Score completions (TRL's reward-function convention)."""
        rewards: list[float | None] = []
        for correct, ids in zip(accuracy_reward(completions, solution), completion_ids, strict=True):
            if correct is None:
                rewards.append(None)
                continue
            cosine = math.cos(min(len(ids) / self.max_len, 1.0) * math.pi)
            if correct:
                lo, hi = self.min_value_correct, self.max_value_correct
            else:
                lo, hi = self.max_value_wrong, self.min_value_wrong
            rewards.append(float(lo + 0.5 * (hi - lo) * (1.0 + cosine)))
        return rewards


def get_cosine_scaled_reward(
    max_len: int,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
) -> CosineScaledReward:
    """TRL-named factory of :class:`CosineScaledReward` (same arguments).

    Example:
        >>> get_cosine_scaled_reward(10).__name__
        'cosine_scaled_reward'
    """
    return CosineScaledReward(
        max_len, min_value_wrong, max_value_wrong, min_value_correct, max_value_correct
    )
