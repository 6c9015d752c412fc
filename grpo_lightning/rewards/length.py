"""Rewards on the completion tokens: DAPO's soft overlong punishment and a repetition penalty
(TRL's ``other_rewards.py``).

Pure python.
"""

from __future__ import annotations

from typing import Any, Sequence


class SoftOverlongPunishment:
    r"""DAPO's soft length penalty (Eq. 13 of arXiv:2503.14476) over ``len(completion_ids)``.

    With ``L = max_completion_len`` and ``C = soft_punish_cache``: 0 when ``|y| <= L - C``;
    ``(L - C - |y|) / C`` (from 0 down to -1) when ``L - C < |y| <= L``; -1 beyond ``L``. It never
    rewards short completions. Metric name ``soft_overlong_punishment_reward`` (TRL's).

    In YAML, as a ``data.reward_funcs`` item::

        - class_path: grpo_lightning.rewards.SoftOverlongPunishment
          init_args: {max_completion_len: 1024, soft_punish_cache: 256}

    Args:
        max_completion_len: ``L``, normally the generation's ``max_completion_length``.
        soft_punish_cache: ``C``, the length of the soft punishment zone before ``L`` (0: none).

    Example:
        >>> punish = SoftOverlongPunishment(max_completion_len=100, soft_punish_cache=20)
        >>> punish(completion_ids=[[1] * 80, [1] * 90, [1] * 100, [1] * 101])
        [0.0, -0.5, -1.0, -1.0]
    """

    __name__ = "soft_overlong_punishment_reward"

    def __init__(self, max_completion_len: int, soft_punish_cache: int) -> None:
        if max_completion_len <= 0:
            raise ValueError(
                f"SoftOverlongPunishment max_completion_len={max_completion_len}: it must be positive."
            )
        if not 0 <= soft_punish_cache <= max_completion_len:
            raise ValueError(
                f"SoftOverlongPunishment soft_punish_cache={soft_punish_cache}: it must be between "
                f"0 and max_completion_len ({max_completion_len})."
            )
        self.max_completion_len = max_completion_len
        self.soft_punish_cache = soft_punish_cache

    def __call__(self, completion_ids: Sequence[Sequence[int]], **kwargs: Any) -> list[float]:
        """Score completions by their token count (TRL's reward-function convention)."""
        limit, cache = self.max_completion_len, self.soft_punish_cache
        rewards = []
        for ids in completion_ids:
            n = len(ids)
            if n <= limit - cache:
                rewards.append(0.0)
            elif n <= limit:
                rewards.append((limit - cache - n) / cache)
            else:
                rewards.append(-1.0)
        return rewards


def get_soft_overlong_punishment(
    max_completion_len: int, soft_punish_cache: int
) -> SoftOverlongPunishment:
    """TRL-named factory of :class:`SoftOverlongPunishment`.

    Args:
        max_completion_len: ``L``, the maximum completion length.
        soft_punish_cache: ``C``, the soft punishment zone before ``L``.

    Returns:
        The reward callable.

    Example:
        >>> get_soft_overlong_punishment(100, 20)(completion_ids=[[1] * 90])
        [-0.5]
    """
    return SoftOverlongPunishment(max_completion_len, soft_punish_cache)


class RepetitionPenalty:
    """Penalty for repeated n-grams of completion tokens (TRL's ``get_repetition_penalty_reward``).

    ``(1 - #unique n-grams / #n-grams) * max_penalty``; 0 for completions shorter than
    ``ngram_size`` tokens. Metric name ``repetition_penalty_reward``.

    Args:
        ngram_size: ``n``.
        max_penalty: The (non-positive) penalty of a completion that is one n-gram repeated.

    Example:
        >>> RepetitionPenalty(ngram_size=2)(completion_ids=[[1, 2, 3, 4], [5, 5, 5, 5, 5], [1]])
        [0.0, -0.75, 0.0]
    """

    __name__ = "repetition_penalty_reward"

    def __init__(self, ngram_size: int = 3, max_penalty: float = -1.0) -> None:
        if ngram_size < 1:
            raise ValueError(f"RepetitionPenalty ngram_size={ngram_size}: it must be >= 1.")
        if max_penalty > 0:
            raise ValueError(f"RepetitionPenalty max_penalty={max_penalty}: it must be <= 0.")
        self.ngram_size = ngram_size
        self.max_penalty = max_penalty

    def __call__(self, completion_ids: Sequence[Sequence[int]], **kwargs: Any) -> list[float]:
        """Score completions by n-gram repetition (TRL's reward-function convention)."""
        rewards = []
        n = self.ngram_size
        for ids in completion_ids:
            ids = list(ids)
            if len(ids) < n:
                rewards.append(0.0)
                continue
            ngrams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
            scaling = 1 - len(set(ngrams)) / len(ngrams)
            rewards.append(scaling * self.max_penalty if scaling else 0.0)  # no -0.0
        return rewards


def get_repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> RepetitionPenalty:
    """TRL-named factory of :class:`RepetitionPenalty` (same arguments).

    Example:
        >>> get_repetition_penalty_reward(1)(completion_ids=[[7, 7]])
        [-0.5]
    """
    return RepetitionPenalty(ngram_size, max_penalty)
