"""Reward functions and reward models: built-ins, loading them from names/paths, and calling them
with TRL's convention.

Layer L1: pure python/torch, no lightning.

``BUILTIN_REWARDS`` maps a built-in reward name (usable in YAML as a ``data.reward_funcs`` item) to
the path of its implementation; entries are imported lazily, on first use, so a built-in with an
optional dependency (``accuracy_reward`` needs the ``[math]`` extra) costs nothing until selected.
An entry that is a class is instantiated with its defaults; the ones that need arguments
(``regex_format_reward``, ``soft_overlong_punishment``, ``cosine_scaled_reward``) are configured
in YAML as ``class_path`` + ``init_args``, e.g.::

    reward_funcs:
      - accuracy_reward
      - class_path: grpo_lightning.rewards.SoftOverlongPunishment
        init_args: {max_completion_len: 1024, soft_punish_cache: 256}
      - Skywork/Skywork-Reward-V2-Qwen3-0.6B     # a reward model: local folder or Hub id
"""

from __future__ import annotations

import importlib
from typing import Any

BUILTIN_REWARDS: dict[str, str] = {
    "accuracy_reward": "grpo_lightning.rewards.accuracy:accuracy_reward",
    "reasoning_accuracy_reward": "grpo_lightning.rewards.accuracy:reasoning_accuracy_reward",
    "cosine_scaled_reward": "grpo_lightning.rewards.accuracy:CosineScaledReward",
    "think_format_reward": "grpo_lightning.rewards.format:think_format_reward",
    "regex_format_reward": "grpo_lightning.rewards.format:RegexFormatReward",
    "soft_overlong_punishment": "grpo_lightning.rewards.length:SoftOverlongPunishment",
    "repetition_penalty_reward": "grpo_lightning.rewards.length:RepetitionPenalty",
    "exact_match_reward": "grpo_lightning.rewards.exact_match:exact_match_reward",
    "gsm8k_answer_reward": "grpo_lightning.rewards.gsm8k:gsm8k_answer_reward",
    "countdown_reward": "grpo_lightning.rewards.countdown:countdown_reward",
}

from grpo_lightning.rewards.loading import (  # noqa: E402  (the registry must exist first)
    RewardFunction,
    callable_name,
    import_dotted_path,
    is_async_callable,
    resolve_reward_funcs,
)
from grpo_lightning.rewards.reward_model import RewardModel  # noqa: E402
from grpo_lightning.rewards.runner import RewardRunner, RewardScores  # noqa: E402

# Built-in rewards importable from here (``from grpo_lightning.rewards import accuracy_reward``),
# loaded on first access like the registry.
_LAZY: dict[str, str] = {
    "accuracy_reward": "grpo_lightning.rewards.accuracy",
    "reasoning_accuracy_reward": "grpo_lightning.rewards.accuracy",
    "CosineScaledReward": "grpo_lightning.rewards.accuracy",
    "get_cosine_scaled_reward": "grpo_lightning.rewards.accuracy",
    "think_format_reward": "grpo_lightning.rewards.format",
    "RegexFormatReward": "grpo_lightning.rewards.format",
    "regex_format_reward": "grpo_lightning.rewards.format",
    "SoftOverlongPunishment": "grpo_lightning.rewards.length",
    "get_soft_overlong_punishment": "grpo_lightning.rewards.length",
    "RepetitionPenalty": "grpo_lightning.rewards.length",
    "get_repetition_penalty_reward": "grpo_lightning.rewards.length",
    "exact_match_reward": "grpo_lightning.rewards.exact_match",
    "gsm8k_answer_reward": "grpo_lightning.rewards.gsm8k",
    "countdown_reward": "grpo_lightning.rewards.countdown",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BUILTIN_REWARDS",
    "RewardFunction",
    "RewardModel",
    "RewardRunner",
    "RewardScores",
    "callable_name",
    "import_dotted_path",
    "is_async_callable",
    "resolve_reward_funcs",
    *_LAZY,
]
