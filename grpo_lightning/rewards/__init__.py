"""Reward functions: loading them from names/paths and calling them with TRL's convention.

Layer L1: pure python/torch, no lightning.

``BUILTIN_REWARDS`` maps a built-in reward name (usable in YAML as ``data.reward_funcs``) to the
dotted path of its implementation; entries are imported lazily, on first use, so a built-in with
an optional dependency costs nothing until selected.
"""

from __future__ import annotations

BUILTIN_REWARDS: dict[str, str] = {
    "exact_match_reward": "grpo_lightning.rewards.exact_match:exact_match_reward",
    "gsm8k_answer_reward": "grpo_lightning.rewards.gsm8k:gsm8k_answer_reward",
}

from grpo_lightning.rewards.loading import (  # noqa: E402  (the registry must exist first)
    RewardFunction,
    callable_name,
    import_dotted_path,
    is_async_callable,
    resolve_reward_funcs,
)
from grpo_lightning.rewards.runner import RewardRunner, RewardScores  # noqa: E402

__all__ = [
    "BUILTIN_REWARDS",
    "RewardFunction",
    "RewardRunner",
    "RewardScores",
    "callable_name",
    "import_dotted_path",
    "is_async_callable",
    "resolve_reward_funcs",
]
