"""Turning the ``reward_funcs`` setting (names, dotted paths, callables, reward models) into
reward functions.

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

from grpo_lightning.errors import raised_in_package

from grpo_lightning.rewards.reward_model import RewardModel



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


def _builtin(name: str, registry: Mapping[str, str]) -> Any:
    try:
        return import_dotted_path(registry[name])
    except (ImportError, ValueError) as err:
        raise ValueError(
            f"built-in reward '{name}' is not available in this installation ({err})."
        ) from err


def resolve_reward_funcs(
    funcs: Sequence[Any] | str | Callable[..., Any] | torch.nn.Module,
    processing_classes: Sequence[Any] | str | Any | None = None,
    *,
    model_init_kwargs: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
) -> list[RewardFunction]:
    """Resolve the ``data.reward_funcs`` setting into :class:`RewardFunction` records.

    Args:
        funcs: Items (or a single item), each one of: a callable (sync or ``async``); an
            already-resolved :class:`RewardFunction`; a built-in reward name (see
            ``grpo_lightning.rewards.BUILTIN_REWARDS``); a dotted path ``package.module.function``
            (a path to a class is instantiated without arguments); a reward model given as a
            local folder or a Hub id ``org/name`` (any string with a ``/``), or as an ``nn.Module``
            (a sequence classifier with ``num_labels=1``), wrapped in :class:`RewardModel`.
        processing_classes: The ``data.reward_processing_classes`` setting: the tokenizers of the
            reward models, as paths or tokenizer objects. Either one entry per item of ``funcs``
            (``None`` = the model's own tokenizer; entries for reward functions are ignored, as in
            TRL) or a single value used for every reward model.
        model_init_kwargs: Extra ``from_pretrained`` arguments for reward models given as paths.
        trust_remote_code: Allow custom code when loading reward models and their tokenizers.

    Returns:
        One :class:`RewardFunction` per item, in order.

    Raises:
        ValueError: For an unknown name, an unimportable path, a non-callable target, a class
            that needs arguments, or a ``processing_classes`` list of the wrong length.
    """
    from grpo_lightning.rewards import BUILTIN_REWARDS

    if isinstance(funcs, (str, RewardFunction, torch.nn.Module)) or callable(funcs):
        funcs = [funcs]  # type: ignore[list-item]
    items = list(funcs)  # type: ignore[arg-type]
    tokenizers = _per_item(processing_classes, len(items))
    resolved: list[RewardFunction] = []
    for index, (item, tokenizer) in enumerate(zip(items, tokenizers)):
        if isinstance(item, RewardFunction):
            resolved.append(item)
            continue
        func: Any = item
        setting = f"data.reward_funcs[{index}]"
        if isinstance(item, torch.nn.Module):
            func = RewardModel(item, tokenizer, trust_remote_code=trust_remote_code)
        elif isinstance(item, str):
            try:
                func = _resolve_string(item, BUILTIN_REWARDS, tokenizer, model_init_kwargs, trust_remote_code)
            except ValueError as err:
                if not raised_in_package(err):  # the user's own module or reward class failed: its traceback
                    raise
                named = ValueError(f"{setting}={item!r}: {err}")
                for note in getattr(err, "__notes__", ()):  # a reward model's loading context
                    named.add_note(note)
                raise named from err
        if not callable(func):
            raise ValueError(
                f"{setting}: reward {item!r} resolved to a {type(func).__name__}, which is not callable; a "
                "reward function takes keyword arguments (prompts, completions, completion_ids, "
                "...) and returns one float per completion."
            )
        resolved.append(RewardFunction(callable_name(func), func, is_async_callable(func)))
    return resolved


def _per_item(processing_classes: Any, n: int) -> list[Any]:
    """Expand ``data.reward_processing_classes`` to one entry per reward function."""
    if processing_classes is None:
        return [None] * n
    if isinstance(processing_classes, (str, os.PathLike)) or not isinstance(
        processing_classes, (list, tuple)
    ):
        return [processing_classes] * n  # one tokenizer for every reward model
    if len(processing_classes) != n:
        raise ValueError(
            f"data.reward_processing_classes has {len(processing_classes)} entries but there are "
            f"{n} reward functions: give one entry per data.reward_funcs item, in the same order "
            "(null for reward functions and for models that use their own tokenizer), or a single "
            "tokenizer path used for every reward model."
        )
    return list(processing_classes)


def _resolve_string(
    spec: str,
    registry: Mapping[str, str],
    tokenizer: Any = None,
    model_init_kwargs: dict[str, Any] | None = None,
    trust_remote_code: bool = False,
) -> Any:
    spec = spec.strip()
    if spec in registry:
        return _instantiate(spec, _builtin(spec, registry))
    is_path = "/" in spec or os.sep in spec
    if os.path.isdir(os.path.expanduser(spec)) or is_path:
        return RewardModel(
            os.path.expanduser(spec), tokenizer, model_init_kwargs=model_init_kwargs,
            trust_remote_code=trust_remote_code,
        )  # fmt: skip
    if "." in spec or ":" in spec:
        return _instantiate(spec, import_dotted_path(spec))
    builtins = ", ".join(sorted(registry)) or "(none)"
    raise ValueError(
        f"unknown reward function '{spec}'. Built-in rewards: {builtins}. For your own function "
        "give its dotted path 'package.module.function' (the module must be importable); for a "
        "reward model give a local folder or a Hub id 'org/name'."
    )


def _instantiate(spec: str, obj: Any) -> Any:
    """A class named by a reward string is instantiated with no arguments (its defaults)."""
    if not inspect.isclass(obj):
        return obj
    try:
        inspect.signature(obj).bind()
    except TypeError as err:
        path = f"{obj.__module__}.{obj.__qualname__}"
        raise ValueError(
            f"reward '{spec}' is the class {path}, which needs arguments ({err}). Configure it "
            f"in YAML as a data.reward_funcs item:\n  - class_path: {path}\n    init_args: {{...}}"
        ) from err
    return obj()
