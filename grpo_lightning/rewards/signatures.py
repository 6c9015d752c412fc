"""Checking reward functions against a dataset before anything runs.

A reward function is called with TRL's standard keyword arguments plus every dataset column
(spec §5.2). A function that needs a column the dataset lacks, or that cannot accept what it is
given, would fail on the first generation batch, after the model has loaded and the logger has
created a run; reading its signature finds that at construction instead. Nothing here calls user
code.

Layer L1: pure python, no lightning.
"""

from __future__ import annotations

import inspect
from typing import Iterable, Sequence

from grpo_lightning.rewards.loading import RewardFunction
from grpo_lightning.rewards.runner import EXCLUDED_COLUMNS, RESERVED_KWARGS

# Keywords always passed (``environments`` only when environments exist).
_ALWAYS_PASSED = tuple(name for name in RESERVED_KWARGS if name != "environments")


def check_reward_signatures(
    funcs: Sequence[RewardFunction], columns: Iterable[str], dataset: str, extra_fields: Iterable[str] = ()
) -> None:
    """Raise if a reward function cannot be called with the standard arguments and ``columns``.

    Args:
        funcs: The resolved reward functions (``data.reward_funcs``).
        columns: The dataset's columns (``prompt`` included; ``prompt``, ``completion`` and
            ``completion_ids`` are not forwarded, as in TRL).
        dataset: How to name the dataset in the error (e.g. ``"data.dataset 'train.jsonl'"``).
        extra_fields: Further per-completion fields the sampler adds (``Rollout.extra``).

    Raises:
        ValueError: Naming the function and the parameter: a required parameter that is neither
            a standard reward argument nor a column, or (without ``**kwargs``) a standard argument
            or column the function does not accept.
    """
    forwarded = [c for c in columns if c not in EXCLUDED_COLUMNS]
    available = set(RESERVED_KWARGS) | set(forwarded) | set(extra_fields)
    for rf in funcs:
        try:
            parameters = inspect.signature(rf.func).parameters.values()
        except (TypeError, ValueError):  # some builtins and C callables have no signature
            continue
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
            accepted = None
        else:
            accepted = {p.name for p in parameters if p.kind is not inspect.Parameter.POSITIONAL_ONLY}
        for p in parameters:
            required = p.default is inspect.Parameter.empty and p.kind not in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD,
            )  # fmt: skip
            if required and (p.kind is inspect.Parameter.POSITIONAL_ONLY or p.name not in available):
                raise ValueError(
                    f"reward function '{rf.name}' requires the argument '{p.name}', which is neither a "
                    f"standard reward argument ({', '.join(RESERVED_KWARGS)}) nor a column of {dataset} "
                    f"(its columns: {', '.join(forwarded) or 'none besides the prompt'}). Add the column to "
                    f"the dataset, rename the parameter to the column that holds it, or give it a default."
                )
        if accepted is not None:
            unaccepted = [name for name in [*_ALWAYS_PASSED, *forwarded] if name not in accepted]
            if unaccepted:
                raise ValueError(
                    f"reward function '{rf.name}' is called with the keyword arguments "
                    f"{', '.join(unaccepted)} (standard reward arguments and the columns of {dataset}) "
                    "but does not accept them: add **kwargs to its signature, as TRL requires."
                )


__all__ = ["check_reward_signatures"]
