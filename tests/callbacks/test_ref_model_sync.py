"""``RefModelSync`` (TR-DPO): the mix of one parameter is exactly float64's rounded once, every
parameter of a tiny model is mixed, a LoRA reference (the base) takes alpha of the adapter while
the policy stays the same function, and bad settings are refused before any weights load."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from grpo_lightning.callbacks import RefModelSync
from grpo_lightning.callbacks.ref_model_sync import mix_
from grpo_lightning.errors import ConfigError
from grpo_lightning.module.peft_settings import LoRASettings, QuantizationSettings
from grpo_lightning.utils.tiny_models import build_tiny_causal_lm

ALPHA = 0.6


def _expected(ref: torch.Tensor, policy: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    # Independent float64 arithmetic (numpy): (1 - alpha) * ref + alpha * policy, rounded once.
    value = (1.0 - alpha) * ref.detach().double().numpy() + alpha * policy.detach().double().numpy()
    return torch.from_numpy(value).to(ref.dtype)


def test_one_mix_is_float64_rounded_once_and_close_to_trls_float32_form():
    generator = torch.Generator().manual_seed(0)
    ref, policy = torch.randn(2, 5000, generator=generator)
    mixed = ref.clone()
    mix_(mixed, policy, ALPHA)
    assert torch.equal(mixed, _expected(ref, policy))
    # TRL's float32 form rounds (1 - a) * ref, then the sum: it differs from the float64 mix by
    # at most half an ulp of each of those (a cancelling sum can make that many ulps of the result).
    trl = ref.clone().mul_(1 - ALPHA).add_(policy, alpha=ALPHA)
    bound = torch.finfo(torch.float32).eps * ((1 - ALPHA) * ref.abs() + mixed.abs())
    assert bool(((mixed - trl).abs() <= bound).all())
    assert 0 < int((mixed != trl).sum()) < len(mixed) // 2  # the two differ, rarely
    half = ref.bfloat16()  # a bfloat16 weight: mixed in float64, one rounding to bfloat16
    mix_(half, policy.bfloat16(), ALPHA)
    assert torch.equal(half, _expected(ref.bfloat16(), policy.bfloat16()))


def test_chunks_and_non_contiguous_tensors_mix_the_same(monkeypatch):
    import grpo_lightning.callbacks.ref_model_sync as code

    monkeypatch.setattr(code, "_CHUNK", 7)  # many chunks, a short last one
    ref, policy = torch.randn(2, 13, 11)
    chunked = ref.clone()
    mix_(chunked, policy, ALPHA)
    assert torch.equal(chunked, _expected(ref, policy))
    strided = ref.clone().t()  # not contiguous: mixed whole
    mix_(strided, policy.t().contiguous(), ALPHA)
    assert torch.equal(strided, _expected(ref.t(), policy.t()))
    with pytest.raises(ValueError, match="cannot mix"):
        mix_(ref.clone(), policy.t(), ALPHA)


def test_sync_mixes_every_parameter_of_a_separate_reference():
    policy, ref = build_tiny_causal_lm(20, seed=1), build_tiny_causal_lm(20, seed=2)
    before = {name: p.detach().clone() for name, p in ref.named_parameters()}
    callback = RefModelSync(ref_model_mixup_alpha=ALPHA, ref_model_sync_steps=2)
    callback.sync(SimpleNamespace(policy=policy, ref_policy=ref))
    for name, param in ref.named_parameters():
        assert torch.equal(param, _expected(before[name], dict(policy.named_parameters())[name])), name
    callback.sync(SimpleNamespace(policy=policy, ref_policy=ref))  # a second mix starts from the first
    for name, param in ref.named_parameters():
        once = _expected(before[name], dict(policy.named_parameters())[name])
        assert torch.equal(param, _expected(once, dict(policy.named_parameters())[name])), name


def test_alpha_one_copies_the_policy_and_zero_keeps_the_reference():
    policy, ref = build_tiny_causal_lm(20, seed=1), build_tiny_causal_lm(20, seed=2)
    kept = copy.deepcopy(ref)
    RefModelSync(0.0, 1).sync(SimpleNamespace(policy=policy, ref_policy=ref))
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), kept.parameters()))
    RefModelSync(1.0, 1).sync(SimpleNamespace(policy=policy, ref_policy=ref))
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), policy.parameters()))


def test_mismatched_models_are_refused_by_name():
    policy, ref = build_tiny_causal_lm(20, seed=1), build_tiny_causal_lm(20, seed=2, num_layers=1)
    with pytest.raises(RuntimeError, match="different parameters .*layers.1"):
        RefModelSync().sync(SimpleNamespace(policy=policy, ref_policy=ref))


def _module(beta: float = 0.04, peft=None, quantization=None, save_final_model: bool = False):
    settings = SimpleNamespace(peft_config=peft, quantization_config=quantization)
    return SimpleNamespace(needs_reference_logprobs=beta != 0, model_settings=settings,
                           save_final_model=save_final_model)


def _trainer(strategy: str = "SingleDeviceStrategy"):
    return SimpleNamespace(strategy=type(strategy, (), {})())


def test_bad_settings_are_refused_before_any_weights_load():
    for alpha in (-0.1, 1.5):
        with pytest.raises(ConfigError, match=rf"ref_model_mixup_alpha={alpha}: use a value in \[0, 1\]"):
            RefModelSync(ref_model_mixup_alpha=alpha)
    with pytest.raises(ConfigError, match="ref_model_sync_steps=0: use a positive number"):
        RefModelSync(ref_model_sync_steps=0)
    sync = RefModelSync()
    with pytest.raises(ConfigError, match="beta == 0 .*set model.loss.init_args.beta"):
        sync.setup(_trainer(), _module(beta=0.0), "fit")
    sync.setup(_trainer(), _module(beta=0.0), "validate")  # nothing to mix outside training
    sync.setup(_trainer("ModelParallelStrategy"), _module(), "fit")  # a separate reference: any strategy
    lora = LoRASettings()
    sync.setup(_trainer("DDPStrategy"), _module(peft=lora), "fit")
    with pytest.raises(ConfigError, match="quantization_config: the reference is the quantized base"):
        sync.setup(_trainer(), _module(peft=lora, quantization=QuantizationSettings(load_in_4bit=True)), "fit")
    with pytest.raises(ConfigError, match="use_dora"):
        sync.setup(_trainer(), _module(peft=LoRASettings(use_dora=True)), "fit")
    with pytest.raises(ConfigError, match="under ModelParallelStrategy: mixing into sharded LoRA base"):
        sync.setup(_trainer("ModelParallelStrategy"), _module(peft=lora), "fit")
    sync.setup(_trainer(), _module(peft=lora, save_final_model=True), "fit")  # the export takes the synced base
    subclass = SimpleNamespace(strategy=type("GRPODeepSpeedStrategy", (type("DeepSpeedStrategy", (), {}),), {})())
    with pytest.raises(ConfigError, match="under GRPODeepSpeedStrategy: mixing into sharded LoRA base"):
        sync.setup(subclass, _module(peft=lora), "fit")  # a subclass of a sharded strategy is sharded too


def test_state_round_trips():
    sync = RefModelSync(0.5, 3)
    sync.last_synced_step, sync.num_syncs = 9, 3
    other = RefModelSync(0.5, 3)
    other.load_state_dict(sync.state_dict())
    assert (other.last_synced_step, other.num_syncs) == (9, 3)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_lora_reference_takes_alpha_of_the_adapter_and_the_policy_is_unchanged():
    """With the base as reference: new reference = (1 - a) base + a merged policy, exactly in
    float64 (the model is float64 so the function checks are tight); the policy's outputs stay."""
    peft = pytest.importorskip("peft")
    base = build_tiny_causal_lm(20, seed=4).double()
    initial_base = copy.deepcopy(base)
    config = LoRASettings(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"],
                          modules_to_save=["lm_head"], init_lora_weights=False).to_peft()
    policy = peft.get_peft_model(base, config)
    with torch.no_grad():  # the trained copy of lm_head differs from the original
        policy.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.1)
    merged = copy.deepcopy(policy).merge_and_unload()
    ids = torch.randint(4, 20, (3, 9), generator=torch.Generator().manual_seed(0))
    policy_before = _logits(policy, ids)

    RefModelSync(ref_model_mixup_alpha=ALPHA).sync(SimpleNamespace(policy=policy, ref_policy=None))

    torch.testing.assert_close(_logits(policy, ids), policy_before, rtol=1e-12, atol=1e-12)
    expected_ref = copy.deepcopy(initial_base)
    merged_state = merged.state_dict()
    expected_ref.load_state_dict({k: (1 - ALPHA) * v + ALPHA * merged_state[k]
                                  for k, v in initial_base.state_dict().items()})
    with policy.disable_adapter():
        reference = _logits(policy, ids)
    torch.testing.assert_close(reference, _logits(expected_ref, ids), rtol=1e-12, atol=1e-12)
    assert (reference - policy_before).abs().max() > 1e-3  # the adapter and lm_head copy did move the reference


def test_lora_export_after_a_sync_is_the_policy(tmp_path):
    """The merged export reloads the base from the original checkpoint (``load_base``) and must
    then take the policy's own, synced base weights: its logits equal the live policy's."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from grpo_lightning.module.peft_models import export_peft_policy

    checkpoint = tmp_path / "base"
    build_tiny_causal_lm(20, seed=4).save_pretrained(checkpoint)
    config = LoRASettings(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False).to_peft()
    policy = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(checkpoint), config)
    RefModelSync(ref_model_mixup_alpha=ALPHA).sync(SimpleNamespace(policy=policy, ref_policy=None))

    tokenizer = SimpleNamespace(save_pretrained=lambda directory: None)
    export_peft_policy(policy, policy.state_dict(), str(tmp_path / "out"), tokenizer,
                       lambda: AutoModelForCausalLM.from_pretrained(checkpoint))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.randint(4, 20, (3, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(_logits(exported, ids), _logits(policy, ids), rtol=1e-5, atol=1e-5)
    with policy.disable_adapter():  # the base did move: reloading it alone would be wrong
        assert (_logits(policy, ids) - _logits(AutoModelForCausalLM.from_pretrained(checkpoint), ids)).abs().max() > 1e-4


def test_lora_with_a_separate_reference_mixes_parameters():
    """A PeftModel given as a model object with beta != 0 gets a deep-copied reference: every
    parameter (adapter ones too) is mixed, as TRL's zip over parameters would."""
    peft = pytest.importorskip("peft")
    config = LoRASettings(r=2, target_modules=["q_proj"], init_lora_weights=False).to_peft()
    policy = peft.get_peft_model(build_tiny_causal_lm(20, seed=5), config)
    ref = copy.deepcopy(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.01)
    before = {n: p.detach().clone() for n, p in ref.named_parameters()}
    RefModelSync(ALPHA).sync(SimpleNamespace(policy=policy, ref_policy=ref))
    policy_params = dict(policy.named_parameters())
    for name, param in ref.named_parameters():
        assert torch.equal(param, _expected(before[name], policy_params[name])), name


@pytest.mark.slow
def test_fsdp2_shards_mix_in_place_like_the_whole_weights(tmp_path):
    """Two gloo ranks (ref_sync_fsdp2_child.py): a sharded reference mixed shard by shard, and a
    whole one from the sharded policy, both equal the float64 mix of the unsharded weights."""
    from pathlib import Path

    from tests.gloo_ranks import run_two_ranks

    run_two_ranks(Path(__file__).with_name("ref_sync_fsdp2_child.py"), tmp_path)


def test_trl_fields_are_the_callbacks_yaml_arguments(tmp_path):
    """TRL's ``sync_ref_model: true, ref_model_mixup_alpha, ref_model_sync_steps`` in YAML."""
    from grpo_lightning.cli import TRAINER_DEFAULTS, GRPOLightningCLI
    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule

    class ParseOnly(GRPOLightningCLI):
        def instantiate_classes(self) -> None:
            pass

    config = tmp_path / "cfg.yaml"
    config.write_text("""
trainer:
  callbacks:
    - class_path: grpo_lightning.callbacks.RefModelSync
      init_args: {ref_model_mixup_alpha: 0.5, ref_model_sync_steps: 64}
model: {model: unused, loss: {class_path: grpo_lightning.losses.DAPOLoss, init_args: {beta: 0.04}}}
data: {dataset: unused.jsonl, reward_funcs: [exact_match_reward]}
""")
    cli = ParseOnly(GRPOModule, RolloutDataModule, trainer_defaults=TRAINER_DEFAULTS, run=False,
                    args=["--config", str(config)])
    (callback,) = cli.config.trainer.callbacks
    assert dict(vars(callback.init_args)) == {"ref_model_mixup_alpha": 0.5, "ref_model_sync_steps": 64}
    assert (RefModelSync().ref_model_mixup_alpha, RefModelSync().ref_model_sync_steps) == (0.6, 512)  # TRL's defaults
