"""``grpo_lightning.GRPOConfig``: the seed's fields and defaults, TRL's resolution and errors, unknown
names with the closest field, deprecated aliases, and a YAML home for every field."""

from __future__ import annotations

import ast
import dataclasses
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from grpo_lightning.errors import ConfigError
from grpo_lightning.trl_compat import GRPOConfig
from grpo_lightning.trl_compat.config import FIELD_NAMES
from grpo_lightning.trl_compat.field_map import (
    FIELD_TO_YAML, NOT_APPLICABLE, PENDING, not_applicable_reason, pending_key, yaml_key,
)
from grpo_lightning.trl_compat.training_arguments import TrainingArgumentsFields
from tests.trl_compat.seed_examples import split_top_level

REPO = Path(__file__).resolve().parents[2]
SEED_DOC = Path(os.environ.get("GRPO_SEED_DOC", REPO.parent / "shared/reference/seed/000_0c41d8174bca6920.txt"))

# Fields of the installed TRL 1.16 GRPOConfig that the seed's list does not have: transformers 5.x
# renamed gradient_checkpointing(_kwargs) to activation_checkpointing(_kwargs), keeping the old
# names as deprecated aliases; the seed documents the old names, and so do we.
NOT_IN_SEED = {"activation_checkpointing", "activation_checkpointing_kwargs"}


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def seed_signature() -> dict[str, str]:
    """``name -> default`` (source text) of the seed's ``trl.GRPOConfig(...)`` signature line."""
    if not SEED_DOC.is_file():
        pytest.skip(f"the seed document is not at {SEED_DOC}: set GRPO_SEED_DOC to its path")
    match = re.search(r"^trl\.GRPOConfig\((.*)\)$", SEED_DOC.read_text(), re.M)
    assert match, "the seed's GRPOConfig signature line was not found"
    params = split_top_level(match.group(1))
    return {p.split(":", 1)[0].strip(): p.rpartition(" = ")[2].strip() for p in params}


def test_every_seed_field_in_the_seed_order_with_the_seed_default():
    seed = seed_signature()
    assert len(seed) == 189
    assert list(FIELD_NAMES) == list(seed)
    defaults = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory() for f in
                dataclasses.fields(GRPOConfig)}
    for name, text in seed.items():
        expected = [] if text == "<factory>" else ast.literal_eval(text)
        assert defaults[name] == expected and type(defaults[name]) is type(expected), name


def test_every_field_has_help_and_a_yaml_home():
    for f in dataclasses.fields(GRPOConfig):
        assert len(f.metadata["help"]) > 10, f.name
    assert set(FIELD_TO_YAML) == set(FIELD_NAMES)
    sections = ("model.", "data.", "trainer.", "seed_everything", "ckpt_path", "checkpoint_every_n_steps",
                "keep_checkpoints")
    for name, home in FIELD_TO_YAML.items():
        if home.startswith(NOT_APPLICABLE):
            assert yaml_key(name) is None and len(not_applicable_reason(name)) > 10, name
        elif home.startswith(PENDING):
            assert yaml_key(name) is None and pending_key(name).startswith(sections), name
        else:
            assert home.startswith(sections) and " " not in home, (name, home)
            assert yaml_key(name) == home and not_applicable_reason(name) is None


# Every field is named: the generated table of docs/trl_mapping.md lists them all (the test below
# also fails when a field goes missing from the hand-written tables' backticks and the table alike).
DOC_MISSING: set[str] = set()


def doc_field_names(doc: str) -> set[str]:
    """Field names a markdown table mentions in backticks: `name`, `name=value`, the shorthand
    `entropy_coef_min/max/delta`, and a `_suffix` after a full name (`sapo_temperature_pos` / `_neg`)."""
    found: set[str] = set()
    last = None
    for token in re.findall(r"`([^`\n]+)`", doc):
        if re.fullmatch(r"[a-z0-9][a-z0-9_]*(=[^`]*)?", token):
            last = token.split("=")[0]
            found.add(last)
        elif re.fullmatch(r"[a-z0-9_]+(/[a-z0-9_]+)+", token):
            first, *rest = token.split("/")
            found |= {first, *(f"{first.rsplit('_', 1)[0]}_{r}" for r in rest)}
        elif re.fullmatch(r"_[a-z0-9_]+", token) and last:
            found.add(last.rsplit("_", 1)[0] + token)
    return found


def test_docs_trl_mapping_names_every_field():
    named = doc_field_names((REPO / "docs" / "trl_mapping.md").read_text())
    missing = {name for name in FIELD_NAMES if name not in named}
    assert missing <= DOC_MISSING, f"fields docs/trl_mapping.md does not name: {sorted(missing - DOC_MISSING)}"
    assert DOC_MISSING <= {f.name for f in dataclasses.fields(TrainingArgumentsFields)}


def test_docs_trl_mapping_table_is_generated_from_field_to_yaml():
    from grpo_lightning.trl_compat.mapping_doc import BEGIN, END, render_table, updated

    doc = (REPO / "docs" / "trl_mapping.md").read_text()
    assert doc.count(BEGIN) == 1 and doc.count(END) == 1, "the generated section's markers are missing"
    assert updated(doc) == doc, "docs/trl_mapping.md is stale: run python scripts/gen_trl_mapping.py"
    table = render_table()
    for name in FIELD_NAMES:  # one row per field, with its key or its reason
        (row,) = [line for line in table.splitlines() if line.startswith(f"| `{name}` |")]
        key = yaml_key(name)
        assert (f"`{key}`" in row) if key else (pending_key(name) or not_applicable_reason(name)) in row, row


def test_resolution_as_trl():
    c = GRPOConfig()
    assert (c.bf16, c.output_dir, c.steps_per_generation, c.generation_batch_size) == (True, "trainer_output", 1, 8)
    assert c.pad_to_multiple_of is None and c.disable_tqdm is False and c.do_eval is False
    assert GRPOConfig(fp16=True, bf16=None).bf16 is False
    c = GRPOConfig(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=3)
    assert (c.steps_per_generation, c.generation_batch_size) == (3, 12)
    c = GRPOConfig(per_device_train_batch_size=4, num_generations=4, generation_batch_size=16)
    assert c.steps_per_generation == 4
    assert GRPOConfig(per_device_train_batch_size=4, num_generations=2, steps_per_generation=2).generation_batch_size == 8
    assert [GRPOConfig(scale_rewards=v).scale_rewards for v in (True, False, "batch")] == ["group", "none", "batch"]
    assert [GRPOConfig(pad_to_multiple_of=v).pad_to_multiple_of for v in ("64", "None", 8)] == [64, None, 8]
    assert GRPOConfig(include_num_input_tokens_seen=True).include_num_input_tokens_seen == "all"
    c = GRPOConfig(eval_strategy="steps", logging_steps=5)
    assert (c.do_eval, c.eval_steps) == (True, 5)
    assert GRPOConfig(torch_compile_mode="max-autotune").torch_compile is True
    assert GRPOConfig(metric_for_best_model="eval_loss").greater_is_better is False
    assert GRPOConfig(metric_for_best_model="eval_reward").greater_is_better is True


def test_world_size_from_the_launcher(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    c = GRPOConfig(per_device_train_batch_size=2, num_generations=8)
    assert c.generation_batch_size == 8
    with pytest.raises(ConfigError, match=r"global batch per_device_train_batch_size x processes = 8"):
        GRPOConfig(per_device_train_batch_size=2, generation_batch_size=12, num_generations=4)


# kwargs -> the message; ``ours`` marks the checks TRL does not make (or makes by crashing).
BAD = {
    "one generation": (dict(num_generations=1), r"num_generations=1: GRPO needs at least 2", False),
    "no generations": (dict(num_generations=None), r"num_generations=None", True),
    "partial groups": (dict(num_generations=3), r"generation_batch_size=8 must be a multiple of num_generations=3", False),
    "not the global batch": (dict(generation_batch_size=12), r"generation_batch_size=12 must be a multiple of the global", False),
    "both batch knobs": (dict(generation_batch_size=16, steps_per_generation=2), r"cannot both be set", False),
    "zero steps": (dict(steps_per_generation=0), r"steps_per_generation=0: use a positive int", True),
    "auto batch": (dict(auto_find_batch_size=True), r"auto_find_batch_size=True is not supported", False),
    "hub without logging": (dict(log_completions_hub_repo="me/completions"), r"log_completions_hub_repo is set but", False),
    "context parallel": (dict(parallelism_config={"cp_size": 2}), r"context or sequence parallelism", True),
    "clip order": (dict(vllm_importance_sampling_clip_min=3.0), r"clip_min \(3.0\) must be below .*clip_max \(3.0\)", False),
    "truncate unbounded": (dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=None),
                           r"'token_truncate' clamps the ratio", False),
    "eval groups": (dict(eval_strategy="steps", eval_steps=10, per_device_eval_batch_size=6, num_generations=4,
                         per_device_train_batch_size=8), r"global eval batch .* 6 x 1 must be a multiple .* group size 4", False),
    "both precisions": (dict(fp16=True, bf16=True), r"fp16 and bf16 are both on", False),
    "both eval precisions": (dict(fp16_full_eval=True, bf16_full_eval=True), r"fp16_full_eval and bf16_full_eval", False),
    "bad schedule": (dict(lr_scheduler_type="cosin"), r"lr_scheduler_type='cosin' is not one of .* Did you mean 'cosine'", False),
    "bad strategy": (dict(save_strategy="step"), r"save_strategy='step' .* Did you mean 'steps'", False),
    "no logging steps": (dict(logging_steps=0), r"logging_strategy='steps' needs a non-zero logging_steps", False),
    "fractional steps": (dict(logging_steps=2.5), r"logging_steps=2.5: above 1 it must be a whole number", False),
    "negative warmup": (dict(warmup_steps=-1), r"warmup_steps=-1: it must be >= 0", False),
    "prefetch without workers": (dict(dataloader_prefetch_factor=2), r"dataloader_prefetch_factor needs", False),
    "cache steps": (dict(torch_empty_cache_steps=0), r"torch_empty_cache_steps=0: use a positive int", False),
    "best model strategies": (dict(load_best_model_at_end=True), r"save_strategy \('steps'\) to equal eval_strategy \('no'\)", False),
    "best model steps": (dict(load_best_model_at_end=True, eval_strategy="steps", eval_steps=3, save_steps=5),
                         r"save_steps \(5\) to be a multiple of eval_steps \(3\)", False),
    "plateau without eval": (dict(lr_scheduler_type="reduce_lr_on_plateau"), r"follows an evaluation metric", False),
    "bad padding": (dict(pad_to_multiple_of="lots"), r"pad_to_multiple_of='lots': use an int", False),
}


@pytest.mark.parametrize("case", BAD, ids=str)
def test_each_inconsistent_setting_gets_one_clear_error(case):
    kwargs, message, _ = BAD[case]
    with pytest.raises(ConfigError, match=message):
        GRPOConfig(**kwargs)


def test_unknown_names_get_the_closest_field():
    with pytest.raises(TypeError, match=r"no field 'learning_rat'\. Did you mean 'learning_rate'\?"):
        GRPOConfig(learning_rat=1e-5)
    with pytest.raises(TypeError, match=r"'num_generation'\. Did you mean 'num_generations'.*'bta'\. Did you mean 'beta'"):
        GRPOConfig(num_generation=4, bta=0.1)
    with pytest.raises(TypeError, match=r"the seed's GRPOConfig calls it 'eval_strategy'"):
        GRPOConfig(evaluation_strategy="steps")
    with pytest.raises(TypeError, match=r"no field 'zzz'\. See dataclasses.fields\(GRPOConfig\)"):
        GRPOConfig(zzz=1)


def test_deprecated_aliases_warn_and_move_their_value():
    with pytest.warns(FutureWarning, match=r"vllm_importance_sampling_cap is deprecated .* use "
                                           r"vllm_importance_sampling_clip_max instead") as record:
        c = GRPOConfig(vllm_importance_sampling_cap=2.0)
    assert c.vllm_importance_sampling_clip_max == 2.0
    assert record[0].filename == __file__  # the warning points at the caller
    with pytest.warns(FutureWarning, match=r"use_transformers_paged is deprecated .* use_transformers_continuous_batching"):
        assert GRPOConfig(use_transformers_paged=True).use_transformers_continuous_batching is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GRPOConfig()  # no warning without them


def test_import_grpo_lightning_stays_cheap():
    code = ("import sys, grpo_lightning; assert 'torch' not in sys.modules; c = grpo_lightning.GRPOConfig(); "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)
    import grpo_lightning

    assert grpo_lightning.GRPOConfig is GRPOConfig and "GRPOConfig" in dir(grpo_lightning)
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        grpo_lightning.Nope  # noqa: B018


# ---- against the installed TRL (the dev extra) ----


def _trl():
    return pytest.importorskip("trl")


@pytest.mark.trl
def test_fields_and_defaults_equal_trl():
    trl = _trl()
    theirs = {f.name: f for f in dataclasses.fields(trl.GRPOConfig)}
    # beyond the seed's fields only those (from transformers 5.24's TrainingArguments; absent before)
    assert set(theirs) - set(FIELD_NAMES) <= NOT_IN_SEED and set(FIELD_NAMES) <= set(theirs)
    assert [n for n in theirs if n not in NOT_IN_SEED] == list(FIELD_NAMES)  # same order
    for f in dataclasses.fields(GRPOConfig):
        other = theirs[f.name]
        default = other.default if other.default is not dataclasses.MISSING else other.default_factory()
        default = getattr(default, "value", default)  # transformers' str enums
        ours = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert ours == default, f.name


@pytest.mark.trl
def test_choice_lists_equal_transformers():
    from transformers.trainer_utils import HubStrategy, IntervalStrategy, SaveStrategy, SchedulerType

    from grpo_lightning.trl_compat import checks

    assert checks.SCHEDULER_TYPES == tuple(s.value for s in SchedulerType)
    assert checks.INTERVAL_STRATEGIES == tuple(s.value for s in IntervalStrategy)
    assert checks.SAVE_STRATEGIES == tuple(s.value for s in SaveStrategy)
    assert checks.HUB_STRATEGIES == tuple(s.value for s in HubStrategy)


RESOLVED = ("bf16", "steps_per_generation", "generation_batch_size", "scale_rewards", "pad_to_multiple_of", "do_eval",
            "eval_steps", "torch_compile", "greater_is_better", "include_num_input_tokens_seen",
            "vllm_importance_sampling_clip_max", "use_transformers_continuous_batching")
SETTINGS = [
    {}, dict(per_device_train_batch_size=4, num_generations=4, gradient_accumulation_steps=3),
    dict(per_device_train_batch_size=4, num_generations=4, generation_batch_size=16), dict(steps_per_generation=2),
    dict(scale_rewards=False), dict(pad_to_multiple_of="64"), dict(eval_strategy="steps", logging_steps=5),
    dict(torch_compile_mode="default"), dict(metric_for_best_model="eval_loss"), dict(include_num_input_tokens_seen=True),
    dict(vllm_importance_sampling_cap=2.0), dict(use_transformers_paged=True),
]


@pytest.mark.trl
def test_resolved_values_and_errors_equal_trl(tmp_path):
    trl = _trl()
    warnings.simplefilter("ignore", FutureWarning)  # pytest restores the filters after the test
    for kwargs in SETTINGS:
        kwargs = {"use_cpu": True, **kwargs}  # TRL checks bf16 hardware; on CPU it needs use_cpu
        theirs = trl.GRPOConfig(output_dir=str(tmp_path), **kwargs)
        ours = GRPOConfig(output_dir=str(tmp_path), **kwargs)
        for name in RESOLVED:
            assert getattr(ours, name) == getattr(getattr(theirs, name), "value", getattr(theirs, name)), (kwargs, name)
    for case, (kwargs, _, ours_only) in BAD.items():
        if ours_only or "fp16" in kwargs or "fp16_full_eval" in kwargs:
            continue  # fp16 needs a GPU in transformers
        with pytest.raises(ValueError):
            trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **kwargs)
