"""Countdown reward: an arithmetic expression that uses the given numbers and hits the target.

Pure python. The expression is checked on its ``ast`` and evaluated with exact fractions; it is
never passed to ``eval``.
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction
from typing import Any, Sequence

from grpo_lightning.rewards.exact_match import _completion_text

MAX_EXPRESSION_CHARS = 300  # a Countdown answer is short; a huge one is not worth parsing
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_SYMBOLS = {"×": "*", "·": "*", "÷": "/", "−": "-", "\\times": "*", "\\cdot": "*", "\\div": "/"}


def extract_expression(text: str) -> str:
    """The candidate answer: the content of the last ``<answer>...</answer>``, else the last line.

    >>> extract_expression("<think>...</think><answer> (100 - 93) + 30 </answer>")
    '(100 - 93) + 30'
    >>> extract_expression("Let me try.\\n100 - 93 + 30\\n")
    '100 - 93 + 30'
    """
    answers = _ANSWER.findall(text)
    if answers:
        return answers[-1].strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def evaluate_expression(expression: str, numbers: Sequence[int]) -> Fraction | None:
    """The exact value of ``expression`` if it uses each of ``numbers`` exactly once, else ``None``.

    Allowed: integer literals, ``+ - * /``, unary minus and parentheses; ``×``/``÷``/``\\times``
    are read as ``*``/``/``; a trailing ``= <value>`` is allowed when it states the right value.
    Anything else (names, calls, ``**``, ``//``, decimals), a number used twice or not at all, or
    a division by zero gives ``None``.

    >>> evaluate_expression("(100 - 93) + 30", [30, 100, 93])
    Fraction(37, 1)
    >>> evaluate_expression("100 / (93 - 93)", [100, 93, 93]) is None
    True
    >>> evaluate_expression("100 - 93", [30, 100, 93]) is None  # 30 is unused
    True
    """
    for symbol, op in _SYMBOLS.items():
        expression = expression.replace(symbol, op)
    expression = expression.strip().rstrip(".").strip("$ ")
    if not expression or len(expression) > MAX_EXPRESSION_CHARS or expression.count("=") > 1:
        return None
    stated = None
    if "=" in expression:
        expression, _, rhs = expression.partition("=")
        stated = _number(rhs)
        if stated is None:
            return None
    try:
        tree = ast.parse(expression.strip(), mode="eval")
        used: list[int] = []
        value = _evaluate(tree.body, used)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None
    if sorted(used) != sorted(int(n) for n in numbers):
        return None
    if stated is not None and stated != value:
        return None
    return value


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        return _BINARY[type(node.op)](left, right)  # Fraction / 0 raises ZeroDivisionError
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, used))
    raise ValueError(f"not allowed in a Countdown expression: {type(node).__name__}")


def _number(text: Any) -> Fraction | None:
    try:
        return Fraction(str(text).strip())
    except (ValueError, ZeroDivisionError):
        return None


def _numbers(value: Any) -> list[int] | None:
    items = value.split(",") if isinstance(value, str) else value
    try:
        return [int(str(item).strip()) for item in items]
    except (TypeError, ValueError):
        return None


def countdown_reward(
    completions: Sequence[Any],
    input: Sequence[Any] | None = None,
    output: Sequence[Any] | None = None,
    *,
    nums: Sequence[Any] | None = None,
    target: Sequence[Any] | None = None,
    **kwargs: Any,
) -> list[float | None]:
    r"""1.0 when the completion's expression uses exactly the given numbers and equals the target.

    Dataset rows look like ``{"input": "30,100,93", "output": "23"}`` (the d1 Countdown sets) or
    ``{"nums": [30, 100, 93], "target": 23}`` (TinyZero's ``Countdown-Tasks-3to4``). The
    expression is the content of the last ``<answer>...</answer>`` of the completion, or its last
    line when there is no answer tag; each given number must appear exactly once (as in d1 and
    TinyZero, which compare the sorted integer literals), combined with ``+ - * /``, parentheses
    and unary minus. It is checked on its syntax tree and evaluated exactly with fractions.

    Differences from TinyZero/d1's ``compute_score``: a well-formed but wrong answer gets 0.0
    here, not their 0.1 "format score" (add a format reward for that); a completion without
    ``<answer>`` tags is read from its last line instead of scoring 0; the value is compared
    exactly, not within 1e-5; ``expr = target`` is accepted.

    Args:
        completions: Strings, or conversational completions (lists of messages).
        input: The available numbers per row: ``"30,100,93"`` or a list of integers.
        output: The target per row (``"23"`` or ``23``).
        nums: Same as ``input``, for datasets that name the column ``nums``.
        target: Same as ``output``, for datasets that name the column ``target``.
        **kwargs: Other dataset columns and trainer state; ignored.

    Returns:
        1.0 or 0.0 per completion; ``None`` for a row whose numbers or target cannot be read.

    Example:
        >>> countdown_reward(
        ...     ["<answer>100 - (93 - 30) - 14</answer>", "<answer>(100 - 93) * 30</answer>",
        ...      "so 100 - 93 + 30 - 14 = 23", "<answer>100 - 93 + 16</answer>"],
        ...     ["30,100,93,14"] * 4, ["23"] * 4)
        [1.0, 0.0, 1.0, 0.0]
        >>> countdown_reward(["<answer>(100 - 93) * 4</answer>"], nums=[[4, 100, 93]], target=[28])
        [1.0]
    """
    available = input if input is not None else nums
    goals = output if output is not None else target
    if available is None or goals is None:
        raise ValueError(
            "countdown_reward needs the dataset columns 'input' and 'output' (d1 format) or 'nums' "
            "and 'target' (TinyZero format)."
        )
    rewards: list[float | None] = []
    for completion, row_numbers, row_goal in zip(completions, available, goals, strict=True):
        numbers, goal = _numbers(row_numbers), _number(row_goal)
        if not numbers or goal is None:
            rewards.append(None)
            continue
        expression = extract_expression(_completion_text(completion))
        # "so 100 - 93 + 30 - 14 = 23" on a last line: keep the arithmetic tail only.
        if "<answer>" not in _completion_text(completion):
            expression = _arithmetic_tail(expression)
        value = evaluate_expression(expression, numbers)
        rewards.append(1.0 if value is not None and value == goal else 0.0)
    return rewards


_TAIL = re.compile(r"[\d\s+\-*/()=×÷−·]+$")


def _arithmetic_tail(line: str) -> str:
    """The longest suffix of ``line`` made of digits, operators, parentheses and ``=``."""
    match = _TAIL.search(line.rstrip(". "))
    return match.group(0).strip() if match else line
