"""``GRPOConfig`` -> ``grpo fit`` config: every field is read by one converter
(``convert_training``, ``convert_grpo``) or has no YAML home (``field_map.FIELD_TO_YAML`` says why).

A field without a home that is left at its default is nothing to talk about; set to another value it
is reported once (a warning listing each with its reason), or refused when ignoring it would change
what is trained (``REFUSED_WHEN_SET``).

Layer L7 (trl_compat): the standard library only.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import fields
from typing import Any

from grpo_lightning.errors import ConfigError
from grpo_lightning.trl_compat import convert_grpo, convert_training
from grpo_lightning.trl_compat.builder import ConfigBuilder
from grpo_lightning.trl_compat.convert_training import Context, epoch_fraction
from grpo_lightning.trl_compat.field_map import not_applicable_reason

CONVERTERS = {**convert_training.CONVERTERS, **convert_grpo.CONVERTERS}
#: The callback every run gets: step logs and the final evaluation as transformers' DefaultFlowCallback
#: has them (named by path: this module imports the standard library only), and the fields it reads.
FLOW_CALLBACK = "grpo_lightning.trl_compat.flow.TRLStepFlow"
FLOW_FIELDS = ("logging_first_step",)
CONVERTED: frozenset[str] = frozenset(name for names in CONVERTERS.values() for name in names) | set(FLOW_FIELDS)
#: Fields ``GRPOTrainer`` itself reads (``save_model`` / ``push_to_hub``), not the YAML file.
FACADE_FIELDS = ("push_to_hub", "hub_token", "hub_model_id", "hub_strategy", "hub_always_push", "hub_revision",
                 "resume_from_checkpoint")
#: Fields without a YAML key that a converter still reads, to refuse a value it cannot honour.
READ_TO_REFUSE = ("lr_scheduler_kwargs",)
#: Fields with no home whose effect on training would be lost without a word: refused when set.
REFUSED_WHEN_SET = {
    "neftune_noise_alpha": "NEFTune noise is not implemented (TRL adds it to the embeddings during training)",
    "auto_find_batch_size": "batch sizes are never changed behind your back (a group must stay whole)",
    "average_tokens_across_devices": "token-normalised losses always count the tokens of all ranks",
}


@functools.lru_cache(maxsize=1)
def _defaults() -> dict[str, Any]:
    from grpo_lightning.trl_compat.config import GRPOConfig

    default = GRPOConfig()
    return {f.name: getattr(default, f.name) for f in fields(default)}


def convert_config(config: Any, builder: ConfigBuilder, ctx: Context) -> None:
    """Write every field of ``config`` (a resolved ``GRPOConfig``) into ``builder``; warn once about
    set fields that have no effect.

    Raises:
        ConfigError: A value with no equivalent here (the message names the field and the way out).
    """
    for converter in CONVERTERS:
        converter(config, builder, ctx)
    # Last, so the converters' callbacks keep their places: transformers' flow of logs and evaluations.
    evaluate_at_end = config.eval_strategy == "steps" and ctx.has_eval_dataset
    fractions = {"logging_fraction": epoch_fraction(config, config.logging_steps),
                 "eval_fraction": epoch_fraction(config, config.eval_steps) if evaluate_at_end else None,
                 "save_fraction": epoch_fraction(config, config.save_steps) if config.save_strategy == "steps" else None}
    builder.append("trainer.callbacks", {"class_path": FLOW_CALLBACK, "init_args": {
        "evaluate_at_end": evaluate_at_end, "log_first_step": bool(config.logging_first_step),
        **{name: value for name, value in fractions.items() if value is not None}}})
    defaults = _defaults()
    for f in fields(config):
        reason = not_applicable_reason(f.name)
        if reason is None or f.name in FACADE_FIELDS or f.name in READ_TO_REFUSE:
            continue
        value = getattr(config, f.name)
        if value == defaults[f.name] or f.name in ("do_eval", "generation_batch_size"):
            continue
        if f.name in REFUSED_WHEN_SET:
            raise ConfigError(f"GRPOConfig.{f.name}={value!r} is not supported: {REFUSED_WHEN_SET[f.name]}; remove it.")
        builder.ignore(f.name, value, reason)
    if builder.ignored:
        warnings.warn("GRPOConfig settings that have no effect in grpo-lightning: " + "; ".join(builder.ignored),
                      UserWarning, stacklevel=3)
