"""Turning the ``reward_funcs`` setting (names, dotted paths, callables) into reward functions.

Layer L1: pure python/torch, no lightning.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

REWARD_MODEL_LATER = (
    "reward models (a model path, Hub id or nn.Module) arrive in a later release of "
    "grpo_lightning; for now give reward functions: a built-in name or a dotted path "
    "'package.module.function'."
)


@dataclass(frozen=True)
class RewardFunction:
    """A resolved reward function.

    Attributes:
        name: Display name used in metrics (``rewards/<name>/mean``): the function's
            ``__name__`` (``functools.partial`` unwrapped) or, for a callable object, its class name.
        func: The callable, called with the TRL keyword-argument convention (spec §5.2).
        is_async: True when calling ``func`` returns a coroutine (``async def`` function, partial
            of one, or an object whose ``__call__`` is ``async def``).
    """

    name: str
    func: Callable[..., Any]
    is_async: bool


def callable_name(func: Callable[..., Any]) -> str:
    """TRL's display name of a reward callable (``get_callable_name``).

    Args:
        func: A function, a ``functools.partial`` of one, or a callable object.

    Returns:
        ``__name__`` of the (unwrapped) function, else the object's class name.
    """
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def is_async_callable(func: Callable[..., Any]) -> bool:
    """Whether calling ``func`` returns a coroutine (partials unwrapped, ``__call__`` inspected).

    Args:
        func: The callable to inspect.

    Returns:
        True for ``async def`` functions, partials of them and objects with ``async def __call__``.
    """
    while isinstance(func, functools.partial):
        func = func.func
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(
        getattr(func, "__call__", None)
    )


def import_dotted_path(path: str) -> Any:
    """Import ``package.module.attr`` (or ``package.module:attr``) and return the attribute.

    Args:
        path: Dotted path; nested attributes (``pkg.mod.Class.method``) are allowed.

    Returns:
        The object the path names.

    Raises:
        ValueError: If no prefix of the path is an importable module or the attribute is missing.
    """
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
        candidates = [(module_name, attr_path.split("."))]
    else:
        parts = path.split(".")
        candidates = [(".".join(parts[:i]), parts[i:]) for i in range(len(parts) - 1, 0, -1)]
    first_error: Exception | None = None
    for module_name, attrs in candidates:
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            # Only swallow "this prefix is not a module"; a missing import *inside* it is real.
            if err.name is None or not (
                module_name == err.name or module_name.startswith(err.name + ".")
            ):
                raise
            first_error = first_error or err
            continue
        try:
            for attr in attrs:
                obj = getattr(obj, attr)
        except AttributeError as err:
            raise ValueError(
                f"cannot load '{path}': module '{module_name}' has no attribute "
                f"'{'.'.join(attrs)}'."
            ) from err
        return obj
    raise ValueError(
        f"cannot import '{path}': no module found ({first_error}). Give the full dotted path "
        "'package.module.function' of an importable module (is it on PYTHONPATH?)."
    ) from first_error


def _builtin(name: str, registry: Mapping[str, str]) -> Callable[..., Any]:
    try:
        return import_dotted_path(registry[name])
    except (ImportError, ValueError) as err:
        raise ValueError(
            f"built-in reward '{name}' is not available in this installation ({err})."
        ) from err


def resolve_reward_funcs(
    funcs: Sequence[str | Callable[..., Any] | RewardFunction] | str | Callable[..., Any],
) -> list[RewardFunction]:
    """Resolve the ``data.reward_funcs`` setting into :class:`RewardFunction` records.

    Args:
        funcs: Items (or a single item) that are either a callable (sync or ``async``), an
            already-resolved :class:`RewardFunction`, a built-in reward name (see
            ``grpo_lightning.rewards.BUILTIN_REWARDS``) or a dotted path
            ``package.module.function``.

    Returns:
        One :class:`RewardFunction` per item, in order.

    Raises:
        ValueError: For an unknown name, an unimportable path, a non-callable target, or a reward
            model (not supported yet).
    """
    from grpo_lightning.rewards import BUILTIN_REWARDS

    if isinstance(funcs, (str, RewardFunction)) or callable(funcs):
        funcs = [funcs]  # type: ignore[list-item]
    resolved: list[RewardFunction] = []
    for item in funcs:  # type: ignore[union-attr]
        if isinstance(item, RewardFunction):
            resolved.append(item)
            continue
        if isinstance(item, torch.nn.Module):
            raise ValueError(f"reward {type(item).__name__} is an nn.Module: {REWARD_MODEL_LATER}")
        func: Any = item
        if isinstance(item, str):
            func = _resolve_string(item, BUILTIN_REWARDS)
        if not callable(func):
            raise ValueError(
                f"reward {item!r} resolved to a {type(func).__name__}, which is not callable; a "
                "reward function takes keyword arguments (prompts, completions, completion_ids, "
                "...) and returns one float per completion."
            )
        resolved.append(RewardFunction(callable_name(func), func, is_async_callable(func)))
    return resolved


def _resolve_string(spec: str, registry: Mapping[str, str]) -> Any:
    spec = spec.strip()
    if spec in registry:
        return _builtin(spec, registry)
    if os.path.isdir(os.path.expanduser(spec)) or "/" in spec or os.sep in spec:
        raise ValueError(f"reward '{spec}' looks like a reward model: {REWARD_MODEL_LATER}")
    if "." in spec or ":" in spec:
        return import_dotted_path(spec)
    builtins = ", ".join(sorted(registry)) or "(none)"
    raise ValueError(
        f"unknown reward function '{spec}'. Built-in rewards: {builtins}. For your own function "
        "give its dotted path 'package.module.function' (the module must be importable)."
    )
