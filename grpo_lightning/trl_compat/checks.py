"""What ``GRPOConfig.__post_init__`` checks and resolves: the ``TrainingArguments`` rules a GRPO
user meets, then GRPO's own (spec §10.1), each with one message naming the field and the fix.

The conditions are TRL 1.16's (transformers' for the ``TrainingArguments`` part); hardware checks
(bf16 support, TF32) are left to the trainer that runs the config. Every error is a
:class:`~grpo_lightning.errors.ConfigError` (a ``ValueError``, as TRL raises).

Layer L7 (trl_compat): the standard library and ``grpo_lightning.errors`` only.
"""

from __future__ import annotations

import difflib
import os
import warnings
from typing import Any, Iterable

from grpo_lightning.errors import ConfigError

# transformers' enums (trainer_utils): the values a string field may take.
SCHEDULER_TYPES = (
    "linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt",
    "reduce_lr_on_plateau", "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay", "greedy",
)  # fmt: skip
INTERVAL_STRATEGIES = ("no", "steps", "epoch")
SAVE_STRATEGIES = ("no", "steps", "epoch", "best")
HUB_STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")
IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")

#: Deprecated field -> its replacement (the seed's "deprecated parameters"); the value moves to it.
DEPRECATED_ALIASES = {
    "use_transformers_paged": "use_transformers_continuous_batching",
    "vllm_importance_sampling_cap": "vllm_importance_sampling_clip_max",
}


def suggestion(name: str, choices: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest of ``choices`` (difflib), or an empty string."""
    close = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f" Did you mean {close[0]!r}?" if close else ""


def check_choice(field: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = suggestion(str(value), choices)
        raise ConfigError(f"GRPOConfig.{field}={value!r} is not one of {', '.join(choices)}.{hint}")


def world_size() -> int:
    """Processes of the run as the launcher states it (``WORLD_SIZE``; 1 without a launcher).
    TRL asks accelerate, which reads the same variable."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def resolve_training_arguments(c: Any) -> None:
    """The ``TrainingArguments`` part of ``__post_init__`` (TRL's base config, then transformers')."""
    c.bf16 = (not c.fp16) if c.bf16 is None else c.bf16
    if c.output_dir is None:
        c.output_dir = "trainer_output"
    check_choice("lr_scheduler_type", c.lr_scheduler_type, SCHEDULER_TYPES)
    for name, choices in (("logging_strategy", INTERVAL_STRATEGIES), ("eval_strategy", INTERVAL_STRATEGIES),
                          ("save_strategy", SAVE_STRATEGIES), ("hub_strategy", HUB_STRATEGIES)):
        check_choice(name, getattr(c, name), choices)
    if isinstance(c.include_num_input_tokens_seen, bool):
        c.include_num_input_tokens_seen = "all" if c.include_num_input_tokens_seen else "no"
    if c.disable_tqdm is None:
        c.disable_tqdm = False
    if c.eval_strategy != "no":
        c.do_eval = True  # transformers: an evaluation schedule means evaluating
    if c.eval_strategy == "steps" and not c.eval_steps:
        if not c.logging_steps:
            raise ConfigError("GRPOConfig: eval_strategy='steps' needs eval_steps (or a non-zero logging_steps, "
                              "which eval_steps defaults to).")
        c.eval_steps = c.logging_steps
    if c.greater_is_better is None and c.metric_for_best_model is not None:
        c.greater_is_better = not c.metric_for_best_model.endswith("loss")
    if (c.torch_compile_mode is not None or c.torch_compile_backend is not None) and not c.torch_compile:
        c.torch_compile = True  # transformers: naming a mode or backend turns compilation on
    if c.torch_empty_cache_steps is not None and not (
        isinstance(c.torch_empty_cache_steps, int) and c.torch_empty_cache_steps > 0
    ):
        raise ConfigError(f"GRPOConfig.torch_empty_cache_steps={c.torch_empty_cache_steps!r}: use a positive int, "
                          "or None to never empty the cache.")
    if c.logging_strategy == "steps" and c.logging_steps == 0:
        raise ConfigError("GRPOConfig: logging_strategy='steps' needs a non-zero logging_steps.")
    for name, strategy in (("logging_steps", c.logging_strategy), ("eval_steps", c.eval_strategy),
                           ("save_steps", c.save_strategy)):
        steps = getattr(c, name)
        if strategy == "steps" and steps is not None and steps > 1 and steps != int(steps):
            raise ConfigError(f"GRPOConfig.{name}={steps}: above 1 it must be a whole number of steps (below 1 it "
                              "is a fraction of the run).")
    _check_best_model(c)
    if c.fp16 and c.bf16:
        raise ConfigError("GRPOConfig: fp16 and bf16 are both on; choose one (bf16 is on by default unless fp16 "
                          "is set: set bf16=False to train in fp16).")
    if c.fp16_full_eval and c.bf16_full_eval:
        raise ConfigError("GRPOConfig: fp16_full_eval and bf16_full_eval are both on; choose one.")
    if c.lr_scheduler_type in ("reduce_lr_on_plateau", "greedy") and c.eval_strategy == "no":
        raise ConfigError(f"GRPOConfig: lr_scheduler_type={c.lr_scheduler_type!r} follows an evaluation metric; "
                          "set eval_strategy to 'steps' or 'epoch'.")
    if c.warmup_steps < 0:
        raise ConfigError(f"GRPOConfig.warmup_steps={c.warmup_steps}: it must be >= 0.")
    if c.dataloader_num_workers == 0 and c.dataloader_prefetch_factor is not None:
        raise ConfigError("GRPOConfig: dataloader_prefetch_factor needs dataloader_num_workers > 0 (only workers "
                          "prefetch); unset it or add workers.")


def _check_best_model(c: Any) -> None:
    """``load_best_model_at_end`` needs checkpoints at evaluation points (transformers' rule)."""
    if not c.load_best_model_at_end or c.save_strategy == "best":
        return
    if c.eval_strategy != c.save_strategy:
        raise ConfigError(f"GRPOConfig: load_best_model_at_end needs save_strategy ({c.save_strategy!r}) to equal "
                          f"eval_strategy ({c.eval_strategy!r}), or save_strategy='best'.")
    if c.eval_strategy == "steps":
        save, every = c.save_steps, c.eval_steps
        mixed = (save < 1) != (every < 1)
        scale = 1_000_000  # compare fractions of the run as integers, as transformers does
        if mixed or round(save * scale) % round(every * scale) != 0:
            raise ConfigError(f"GRPOConfig: load_best_model_at_end needs save_steps ({save}) to be a multiple of "
                              f"eval_steps ({every}), both steps or both fractions.")


def resolve_grpo(c: Any) -> None:
    """GRPO's part of ``__post_init__`` (TRL 1.16, spec §10.1), in TRL's order."""
    if isinstance(c.pad_to_multiple_of, str) and c.pad_to_multiple_of != "auto":  # a CLI passes strings
        text = c.pad_to_multiple_of.strip().lower()
        try:
            c.pad_to_multiple_of = None if text in ("none", "null") else int(text)
        except ValueError:
            raise ConfigError(f"GRPOConfig.pad_to_multiple_of={c.pad_to_multiple_of!r}: use an int, 'auto' or "
                              "None.") from None
    if c.pad_to_multiple_of == "auto":
        c.pad_to_multiple_of = None  # TRL pads to 128 on AWS Neuron only, a device this package does not run on
    _apply_alias(c, "use_transformers_paged", set_if=c.use_transformers_paged, value=True)
    _check_parallelism(c.parallelism_config)
    c.scale_rewards = {True: "group", False: "none"}.get(c.scale_rewards, c.scale_rewards)
    if c.log_completions_hub_repo is not None and not c.log_completions:
        raise ConfigError("GRPOConfig: log_completions_hub_repo is set but log_completions is False; turn "
                          "log_completions on to upload completions, or unset log_completions_hub_repo.")
    if c.auto_find_batch_size:
        raise ConfigError("GRPOConfig.auto_find_batch_size=True is not supported: halving the batch on "
                          "out-of-memory would split groups of num_generations completions. Lower "
                          "per_device_train_batch_size instead.")
    if not isinstance(c.num_generations, int) or isinstance(c.num_generations, bool) or c.num_generations < 2:
        raise ConfigError(f"GRPOConfig.num_generations={c.num_generations!r}: GRPO needs at least 2 completions per "
                          "prompt to compute advantages (a group's mean and std).")
    _resolve_generation_batch(c, world_size())
    _apply_alias(c, "vllm_importance_sampling_cap", set_if=c.vllm_importance_sampling_cap is not None,
                 value=c.vllm_importance_sampling_cap)
    low, high = c.vllm_importance_sampling_clip_min, c.vllm_importance_sampling_clip_max
    if low is not None and high is not None and low >= high:
        raise ConfigError(f"GRPOConfig: vllm_importance_sampling_clip_min ({low}) must be below "
                          f"vllm_importance_sampling_clip_max ({high}).")
    truncating = c.vllm_importance_sampling_mode in ("token_truncate", "sequence_truncate")
    if c.vllm_importance_sampling_correction and truncating and low is None and high is None:
        raise ConfigError(f"GRPOConfig: vllm_importance_sampling_mode={c.vllm_importance_sampling_mode!r} clamps "
                          "the ratio, so set vllm_importance_sampling_clip_min or _clip_max (default 3.0).")


def _resolve_generation_batch(c: Any, processes: int) -> None:
    """``generation_batch_size`` / ``steps_per_generation``: at most one is given, the other follows
    (spec §1.1); the batch holds whole groups; evaluation batches too when evaluating."""
    global_batch = c.per_device_train_batch_size * processes
    if c.generation_batch_size is not None and c.steps_per_generation is not None:
        raise ConfigError("GRPOConfig: generation_batch_size and steps_per_generation cannot both be set; set one "
                          "(the other follows from per_device_train_batch_size x processes).")
    for name in ("generation_batch_size", "steps_per_generation"):
        value = getattr(c, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ConfigError(f"GRPOConfig.{name}={value!r}: use a positive int, or None to derive it.")
    if c.generation_batch_size is None:
        if c.steps_per_generation is None:
            c.steps_per_generation = c.gradient_accumulation_steps
        c.generation_batch_size = global_batch * c.steps_per_generation
    else:
        if c.generation_batch_size % global_batch != 0:
            raise ConfigError(f"GRPOConfig.generation_batch_size={c.generation_batch_size} must be a multiple of the "
                              f"global batch per_device_train_batch_size x processes = {global_batch}.")
        c.steps_per_generation = c.generation_batch_size // global_batch
    if c.do_eval and c.eval_strategy != "no":
        group = c.num_generations_eval or c.num_generations
        if (c.per_device_eval_batch_size * processes) % group != 0:
            raise ConfigError(f"GRPOConfig: the global eval batch per_device_eval_batch_size x processes = "
                              f"{c.per_device_eval_batch_size} x {processes} must be a multiple of the evaluation "
                              f"group size {group} (num_generations_eval or num_generations).")
    if c.generation_batch_size % c.num_generations != 0:
        raise ConfigError(f"GRPOConfig.generation_batch_size={c.generation_batch_size} must be a multiple of "
                          f"num_generations={c.num_generations} (whole groups only).")


def _check_parallelism(config: Any) -> None:
    """Context / sequence parallelism cannot shard GRPO's inputs (built after generation)."""
    if config is None:
        return
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    cp = get("cp_enabled", None) or (get("cp_size", 1) or 1) > 1
    sp = get("sp_enabled", None) or (get("sp_size", 1) or 1) > 1
    if cp or sp:
        raise ConfigError("GRPOConfig.parallelism_config: context or sequence parallelism (cp_size or sp_size > 1) "
                          "is not supported: GRPO builds its inputs after generation, so they cannot be sharded "
                          "along the sequence. Set cp_size=1 and sp_size=1.")


def _apply_alias(c: Any, old: str, *, set_if: bool, value: Any) -> None:
    """Move a deprecated field's value to its replacement, with a FutureWarning naming it."""
    if not set_if:
        return
    new = DEPRECATED_ALIASES[old]
    warnings.warn(f"GRPOConfig.{old} is deprecated (removed in TRL 2.0): use {new} instead; {new}={value!r} is "
                  "set for you.", FutureWarning, stacklevel=6)
    setattr(c, new, value)
