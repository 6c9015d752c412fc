"""The replay rule: how a Python object given to ``GRPOTrainer`` is named in a YAML file.

* A function or class defined at the top level of an importable module is written as its dotted
  path (``my_rewards.format_reward``); ``grpo fit`` imports it again.
* A lambda, a nested function, a bound method, a callable instance, or anything defined in the
  script being run (``__main__``) has no such name: the run uses it from memory, and the YAML export
  refuses with the reason (move it into a module and import it from there).
* In-memory datasets and tokenizers are written to files in the run folder (``inputs.py``).

Layer L7 (trl_compat): the standard library only.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

from grpo_lightning.trl_compat.builder import InMemory


def dotted_path(obj: Any) -> tuple[str | None, str]:
    """``(path, "")`` when ``obj`` is reachable as ``module.name`` in an importable module, else
    ``(None, reason)``.

    >>> dotted_path(dotted_path)
    ('grpo_lightning.trl_compat.replay.dotted_path', '')
    >>> dotted_path(lambda x: x)[1]
    'a lambda has no importable name: define it with def at the top level of a module'
    """
    name = getattr(obj, "__qualname__", None)
    module = getattr(obj, "__module__", None)
    if not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
        return None, (f"a {type(obj).__name__} object has no importable name: pass a module-level function or "
                      "class, or write its spec in the YAML file yourself")
    if name and name.endswith("<lambda>"):
        return None, "a lambda has no importable name: define it with def at the top level of a module"
    if not name or "<locals>" in name:
        return None, f"{name} is defined inside a function: move it to the top level of a module"
    if module in (None, "__main__", "builtins"):
        return None, (f"{name} is defined in the script being run (__main__), which grpo fit cannot import without "
                      "running it: move it into a module (e.g. my_rewards.py) and import it from there")
    target: Any = sys.modules.get(module)
    for part in name.split("."):
        target = getattr(target, part, None)
    if target is not obj:
        return None, f"{module}.{name} does not name this object (it was replaced or generated): define it in a module"
    return f"{module}.{name}", ""


def by_path(obj: Any, setting: str) -> Any:
    """``obj`` as a config value: a string stays a string; anything else is an :class:`InMemory`
    whose YAML form is its dotted path when it has one."""
    if isinstance(obj, str):
        return obj
    path, reason = dotted_path(obj)
    return InMemory(obj, path, "" if path else f"{setting} {_describe(obj)}: {reason}")


def in_memory_only(obj: Any, setting: str, what_instead: str, *, after_parse: bool = False) -> InMemory:
    """An object the YAML file cannot hold at all (a model object, an optimizer)."""
    return InMemory(obj, None, f"{setting} is a {type(obj).__name__} object: {what_instead}", after_parse)


def _describe(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None) or type(obj).__name__
    return repr(name)
