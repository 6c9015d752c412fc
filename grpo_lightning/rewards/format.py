"""Format rewards: does the completion have the expected shape (TRL's ``format_rewards.py``).

Pure python.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Sequence

from grpo_lightning.rewards.exact_match import _completion_text

THINK_PATTERN = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)


def think_format_reward(completions: Sequence[Any], **kwargs: Any) -> list[float]:
    r"""1.0 when the reasoning is enclosed in one ``<think>...</think>`` block at the start, else 0.0.

    The content must match ``^<think>(?!.*<think>)(.*?)</think>.*$`` (DOTALL, MULTILINE), as in
    TRL: it opens with ``<think>``, has no second ``<think>`` and closes the block; anything may
    follow. A conversational completion is read from its last message.

    Args:
        completions: Strings, or conversational completions (lists of messages).
        **kwargs: Other dataset columns and trainer state; ignored.

    Returns:
        1.0 or 0.0 per completion.

    Example:
        >>> think_format_reward(["<think>\nreasoning\n</think>\nanswer",
        ...                      "<think>\nreasoning\nanswer",
        ...                      "<think>a<think>b</think>c",
        ...                      [{"role": "assistant", "content": "<think>x</think>42"}]])
        [1.0, 0.0, 0.0, 1.0]
    """
    return [1.0 if THINK_PATTERN.match(_completion_text(c)) else 0.0 for c in completions]


def _parse_flags(flags: int | str | Sequence[str]) -> int:
    if isinstance(flags, int):
        return flags
    names = flags.replace(",", "|").split("|") if isinstance(flags, str) else list(flags)
    value = 0
    for name in (n.strip().upper() for n in names):
        if not name:
            continue
        flag = getattr(re, name, None)
        if not isinstance(flag, re.RegexFlag):
            raise ValueError(
                f"unknown regex flag {name!r}: use names of Python's re flags such as DOTALL, "
                "MULTILINE, IGNORECASE (e.g. flags: DOTALL|MULTILINE)."
            )
        value |= flag
    return value


class RegexFormatReward:
    r"""Rewards completions that match a regular expression (a format reward).

    In YAML, as a ``data.reward_funcs`` item::

        - class_path: grpo_lightning.rewards.RegexFormatReward
          init_args:
            pattern: '^<think>.*?</think>\s*<answer>.*?</answer>$'
            flags: DOTALL
            name: answer_format

    Args:
        pattern: The regular expression.
        flags: ``re`` flags: an int, or flag names such as ``"DOTALL|MULTILINE"`` or
            ``["DOTALL", "IGNORECASE"]``.
        mode: ``match`` (anchored at the start, like ``re.match``), ``fullmatch`` (the whole text)
            or ``search`` (anywhere).
        reward: Value for a matching completion.
        penalty: Value for a completion that does not match.
        name: Metric name (``rewards/<name>/mean``).

    Example:
        >>> fmt = RegexFormatReward(r"<answer>\d+</answer>\s*$", mode="search", name="answer_tag")
        >>> fmt(["so <answer>42</answer>", "so 42", [{"content": "<answer>7</answer>\n"}]])
        [1.0, 0.0, 1.0]
        >>> fmt.__name__
        'answer_tag'
    """

    def __init__(
        self,
        pattern: str,
        flags: int | str | list[str] = "DOTALL",
        mode: Literal["match", "fullmatch", "search"] = "match",
        reward: float = 1.0,
        penalty: float = 0.0,
        name: str = "regex_format_reward",
    ) -> None:
        if mode not in ("match", "fullmatch", "search"):
            raise ValueError(f"RegexFormatReward mode={mode!r}: use match, fullmatch or search.")
        try:
            self.regex = re.compile(pattern, _parse_flags(flags))
        except re.error as err:
            raise ValueError(f"RegexFormatReward: invalid pattern {pattern!r}: {err}.") from err
        self.pattern = pattern
        self.mode = mode
        self.reward = float(reward)
        self.penalty = float(penalty)
        self.__name__ = name

    def __call__(self, completions: Sequence[Any], **kwargs: Any) -> list[float]:
        """Score completions (TRL's reward-function convention; other keywords are ignored)."""
        test = getattr(self.regex, self.mode)
        return [self.reward if test(_completion_text(c)) else self.penalty for c in completions]

    def __repr__(self) -> str:
        return f"RegexFormatReward({self.pattern!r}, mode={self.mode!r}, name={self.__name__!r})"


def regex_format_reward(pattern: str, **kwargs: Any) -> RegexFormatReward:
    r"""Factory of :class:`RegexFormatReward` (same arguments), for use from Python.

    Example:
        >>> regex_format_reward(r"^\d+$", name="digits_only")(["123", "12a"])
        [1.0, 0.0]
    """
    return RegexFormatReward(pattern, **kwargs)
