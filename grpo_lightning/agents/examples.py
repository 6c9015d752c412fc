"""Ready-made tools and environments for the recipes in ``configs/agents/`` (and as templates for
your own): a calculator tool and the seed documentation's ``IncrementEnv``.

Layer L3 (pure python).
"""

from __future__ import annotations

import ast
import operator
import random

_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
    ast.USub: operator.neg, ast.UAdd: operator.pos,
}  # fmt: skip


def calculate(expression: str) -> str:
    """
    Evaluates an arithmetic expression with +, -, *, /, //, % and ** on numbers.

    Args:
        expression: The expression, for example "35 + 50" or "(3 + 4) * 12".

    Returns:
        The value of the expression.

    >>> calculate("35 + 50"), calculate("(3 + 4) * 12"), calculate("7 / 2")
    ('85', '84', '3.5')
    """
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large (at most 64)")
        return _OPERATORS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
        return _OPERATORS[type(node.op)](_evaluate(node.operand))
    raise ValueError(f"not an arithmetic expression: {ast.unparse(node)!r}")


class IncrementEnv:
    """The seed documentation's environment: a counter the model must bring to a target.

    Without a dataset, ``reset()`` draws the target (1 to 6) and returns the prompt; with a dataset
    whose rows have a ``target`` column, the row's prompt is used and ``reset`` returns ``None``.
    ``get_reward`` is 1.0 when the counter ends on the target.
    """

    def reset(self, target: int | None = None, **kwargs) -> str | None:
        self.counter = 0
        if target is not None:
            self.target = int(target)
            return None
        self.target = random.randint(1, 6)
        return f"Increment the counter by {self.target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


__all__ = ["IncrementEnv", "calculate"]
