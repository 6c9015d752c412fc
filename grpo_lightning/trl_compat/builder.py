"""The ``grpo fit`` config a facade run is: a nested dict (exactly a YAML file's content) being built,
the values in it that exist only in memory, and the settings that were ignored.

A value given to ``GRPOTrainer`` as a Python object (a lambda reward, a model object, a Lightning
callback) goes into the config as an :class:`InMemory`: the run uses the object itself, and the YAML
export uses its YAML form (a dotted path) or refuses with the reason it has none.

Layer L7 (trl_compat): the standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from grpo_lightning.errors import ConfigError


@dataclass(frozen=True)
class InMemory:
    """A config value that the run takes as a Python object.

    Attributes:
        value: The object the run uses.
        yaml: What a YAML file says instead (a dotted path, a class_path spec), or ``None``.
        why_not: Why it has no YAML form and what to do instead (set when ``yaml`` is ``None``).
        after_parse: The CLI parser's type of this key cannot check such an object (a model
            object for ``model.model``): the parsed config holds a placeholder string, and the CLI
            sets the object after parsing (``run_cli(objects=...)``).
    """

    value: Any
    yaml: Any = None
    why_not: str = ""
    after_parse: bool = False


class ReplayError(ConfigError):
    """The run cannot be written as a ``grpo fit`` YAML file (it holds objects that exist only in
    this Python process); the message lists each one with what to do instead."""


@dataclass
class ConfigBuilder:
    """A ``grpo fit`` config under construction: ``set("data.generation.top_p", 0.9)`` and friends.

    Attributes:
        config: The nested config (plain values and :class:`InMemory` leaves).
        ignored: ``field=value: reason`` for each GRPOConfig setting that has no effect here.
    """

    config: dict[str, Any] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)

    def set(self, key: str, value: Any) -> None:
        """Set the dotted ``key`` (``trainer.max_steps``; ``ckpt_path`` at the top level)."""
        *parents, leaf = key.split(".")
        node = self.config
        for name in parents:
            node = node.setdefault(name, {})
        node[leaf] = value

    def get(self, key: str, default: Any = None) -> Any:
        node: Any = self.config
        for name in key.split("."):
            if not isinstance(node, dict) or name not in node:
                return default
            node = node[name]
        return node

    def append(self, key: str, value: Any) -> None:
        """Add ``value`` to the list at ``key`` (``trainer.callbacks``)."""
        items = self.get(key)
        self.set(key, [*(items or []), value])

    def ignore(self, name: str, value: Any, reason: str) -> None:
        self.ignored.append(f"{name}={value!r} ({reason})")


#: What the parsed config holds where the CLI sets an object after parsing.
PLACEHOLDER = "<set from Python after parsing>"


def run_config(config: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the run is given: ``config`` with every :class:`InMemory` replaced by its object, and
    the ``{dotted key: object}`` the CLI sets after parsing (``after_parse`` values)."""
    objects: dict[str, Any] = {}

    def walk(node: Any, where: str) -> Any:
        if isinstance(node, InMemory):
            if node.after_parse:
                objects[where] = node.value
                return PLACEHOLDER
            return node.value
        if isinstance(node, dict):
            return {k: walk(v, f"{where}.{k}" if where else str(k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(node)]
        return node

    return walk(config, ""), objects


def yaml_config(config: Any) -> Any:
    """``config`` with every :class:`InMemory` replaced by its YAML form.

    Raises:
        ReplayError: Some values have no YAML form; the message lists each with its reason.
    """
    problems: list[str] = []

    def walk(node: Any, where: str) -> Any:
        if isinstance(node, InMemory):
            if node.yaml is None:
                problems.append(f"{where}: {node.why_not}")
            return node.yaml
        if isinstance(node, dict):
            return {k: walk(v, f"{where}.{k}" if where else str(k)) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v, f"{where}[{i}]") for i, v in enumerate(node)]
        return node

    out = walk(config, "")
    if problems:
        raise ReplayError("This run cannot be written as a grpo fit YAML file; it still trains from Python. "
                          "Values that exist only in memory:\n  - " + "\n  - ".join(problems))
    return out
