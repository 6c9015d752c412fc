"""GSM8K answer reward: the last number of the completion against the ``#### n`` gold answer.

Pure python.
"""

from __future__ import annotations

import re
from typing import Any, Sequence

from grpo_lightning.rewards.exact_match import _completion_text

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _to_number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("."))
    except ValueError:
        return None


def gold_answer(solution: str) -> float | None:
    """The number after ``####`` in a GSM8K solution (thousands commas removed), or ``None``.

    >>> gold_answer("Natalia sold 48/2 = <<48/2=24>>24 clips ... #### 1,072")
    1072.0
    >>> gold_answer("no marker") is None
    True
    """
    if "####" not in solution:
        return None
    return _to_number(solution.split("####")[-1].strip())


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (``-3``, ``1,234.5``, ``7.``), or ``None``.

    >>> last_number("So she has 3 + 4 = 7 apples.")
    7.0
    >>> last_number("The answer is \\\\boxed{1,234}") , last_number("none")
    (1234.0, None)
    """
    matches = _NUMBER.findall(text)
    return _to_number(matches[-1]) if matches else None


def gsm8k_answer_reward(completions: Sequence[Any], answer: Sequence[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion's last number equals the GSM8K gold answer, else 0.0.

    ``answer`` is the dataset's worked solution ending in ``#### <number>``; a row whose gold
    cannot be parsed gets ``None`` (not applicable), so it does not shape the advantages.

    >>> gsm8k_answer_reward(["... so 18 dollars.", "It is 17"], ["... #### 18", "... #### 18"])
    [1.0, 0.0]
    >>> gsm8k_answer_reward(["42"], ["unparseable"])
    [None]
    """
    rewards: list[float | None] = []
    for completion, solution in zip(completions, answer, strict=True):
        gold = gold_answer(str(solution))
        if gold is None:
            rewards.append(None)
            continue
        guess = last_number(_completion_text(completion))
        rewards.append(1.0 if guess is not None and abs(guess - gold) < 1e-6 else 0.0)
    return rewards
