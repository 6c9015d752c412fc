"""``GRPOConfig``: TRL's configuration object, field for field (the seed's list and defaults).

Layer L7 (trl_compat, a front door beside ``cli``): the standard library and
``grpo_lightning.errors`` only, so building one is instant and needs neither torch nor
transformers.

>>> config = GRPOConfig(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=2)
>>> config.steps_per_generation, config.generation_batch_size, config.bf16
(2, 8, True)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Any

from grpo_lightning.trl_compat.args_properties import TrainingArgumentsProperties
from grpo_lightning.trl_compat.args_setters import TrainingArgumentsSetters
from grpo_lightning.trl_compat.checks import resolve_grpo, resolve_training_arguments, suggestion
from grpo_lightning.trl_compat.grpo_fields import GRPOFields

# transformers 5's names of the seed's fields (the seed's names are their deprecated aliases there):
# accepted as keywords, and readable and writable as properties (TrainingArgumentsProperties).
ALIASES = {
    "activation_checkpointing": "gradient_checkpointing",
    "activation_checkpointing_kwargs": "gradient_checkpointing_kwargs",
}
# Names a user of another transformers may pass that the seed's GRPOConfig calls otherwise (refused).
RENAMED = {
    "evaluation_strategy": "eval_strategy",
    "warmup_ratio": "warmup_steps",
}


@dataclass
class GRPOConfig(GRPOFields, TrainingArgumentsProperties, TrainingArgumentsSetters):
    """Every field of TRL's ``GRPOConfig`` (the seed's documentation: its own fields and the
    ``TrainingArguments`` fields it lists), with the same names, order and defaults.

    ``__post_init__`` resolves and checks them as TRL does: ``bf16`` unset becomes ``not fp16``;
    ``generation_batch_size`` / ``steps_per_generation`` are derived from each other (world size
    from ``WORLD_SIZE``); ``scale_rewards`` ``True``/``False`` become ``"group"``/``"none"``;
    ``pad_to_multiple_of="auto"`` becomes ``None``; deprecated fields (``use_transformers_paged``,
    ``vllm_importance_sampling_cap``) move their value to the new field with a ``FutureWarning``.
    Inconsistent settings raise :class:`~grpo_lightning.errors.ConfigError` (a ``ValueError``), and
    a keyword that is not a field raises ``TypeError`` naming the closest field. transformers 5's
    ``activation_checkpointing(_kwargs)`` are accepted for ``gradient_checkpointing(_kwargs)`` (the
    new name wins when both are given, as in transformers).

    ``TrainingArguments``' read-only properties are there too (``world_size``, ``process_index``,
    ``local_process_index``, ``should_log``, ``should_save``, ``train_batch_size``,
    ``eval_batch_size``, ``n_gpu``, ``device``), with ``to_json_string`` and ``to_sanitized_dict``.

    Each field's help is ``dataclasses.fields(GRPOConfig)[i].metadata["help"]``; where it goes in a
    ``grpo fit`` YAML file is :data:`grpo_lightning.trl_compat.field_map.FIELD_TO_YAML`.
    """

    def __post_init__(self) -> None:
        resolve_training_arguments(self)
        resolve_grpo(self)

    def to_dict(self) -> dict[str, Any]:
        """Every field and its (resolved) value, in field order; the token is masked like TRL's."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: (f"<{k.upper()}>" if k.endswith("_token") and v is not None else v) for k, v in values.items()}


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in fields(GRPOConfig))
_FIELD_SET = frozenset(FIELD_NAMES)


def unknown_field_message(name: str) -> str:
    """Why ``name`` is not a ``GRPOConfig`` field, with the closest field name."""
    if name in RENAMED:
        return f"GRPOConfig has no field {name!r}: the seed's GRPOConfig calls it {RENAMED[name]!r}."
    hint = suggestion(name, FIELD_NAMES) or " See dataclasses.fields(GRPOConfig) or docs/trl_mapping.md."
    return f"GRPOConfig has no field {name!r}.{hint}"


def _resolve_aliases(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with transformers 5's names moved to the seed's: the new name's value wins unless it
    is ``None`` (transformers reads the deprecated name only when the new one is unset)."""
    out = dict(kwargs)
    for new, old in ALIASES.items():
        if new in out:
            value = out.pop(new)
            if value is not None:
                out[old] = value
    return out


def _reject_unknown(init: Any) -> Any:
    @functools.wraps(init)
    def __init__(self: GRPOConfig, *args: Any, **kwargs: Any) -> None:
        kwargs = _resolve_aliases(kwargs)
        unknown = [k for k in kwargs if k not in _FIELD_SET]
        if unknown:
            raise TypeError(" ".join(unknown_field_message(k) for k in unknown))
        init(self, *args, **kwargs)

    return __init__


GRPOConfig.__init__ = _reject_unknown(GRPOConfig.__init__)  # type: ignore[method-assign]
