"""LoRA on the policy: the optimized forward paths on a PEFT model equal the plain path, the
reference is the policy with adapters disabled (no second copy), and bad settings fail at
construction with one message naming the setting."""

from __future__ import annotations

import sys

import pytest
import torch

from grpo_lightning.errors import ConfigError
from grpo_lightning.losses import LOSSES
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.forward import ForwardOptions, completion_logprobs
from grpo_lightning.module.peft_settings import LoRASettings, QuantizationSettings
from tests.helpers import built, make_model_dir
from tests.module.test_forward_paths import (
    OPTIMIZED,
    TEMPERATURE,
    assert_same,
    assert_same_values,
    make_batch,
    reference,
    run,
    tiny,
)

peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'grpo-lightning[peft]')")

HEADS = {
    "adapted-attention": dict(target_modules=["q_proj", "v_proj"]),
    "all-linear": dict(target_modules="all-linear"),
    "lora-on-lm_head": dict(target_modules=["q_proj", "lm_head"]),
    "lm_head-modules_to_save": dict(target_modules=["v_proj"], modules_to_save=["lm_head"]),
}


def lora(model, **settings):
    """``model`` with random (non-zero) LoRA adapters, so that they change every log-prob."""
    torch.manual_seed(0)
    config = LoRASettings(r=4, lora_alpha=8, init_lora_weights=False, **settings).to_peft()
    wrapped = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name or "modules_to_save" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return wrapped


def trainable_grads(model, grads):
    """The entries of a flat gradient (``run``'s order) that belong to trainable parameters."""
    keep = torch.cat([torch.full((p.numel(),), p.requires_grad) for p in model.parameters()])
    return grads[keep]


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize("path", list(OPTIMIZED))
def test_optimized_paths_on_a_lora_model_match_plain(head, path, no_plain_fallback):
    """Loss, entropies and the adapters' gradients of every optimized path equal the float64 plain
    path on the PEFT model (the adapted head included); frozen weights get no gradient."""
    model = lora(tiny("qwen2"), **HEADS[head])
    batch = make_batch()
    want = reference(model, batch, entropy_coef=0.1)
    got = run(model, batch, OPTIMIZED[path], entropy_coef=0.1)
    assert_same(got, want, batch[3])
    assert trainable_grads(model, got[3]).abs().sum() > 0
    frozen = ~torch.cat([torch.full((p.numel(),), p.requires_grad) for p in model.parameters()])
    assert not got[3][frozen].any(), "a frozen base weight received a gradient"


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prompt_prefix_on_a_lora_model_matches_plain(attn, no_plain_fallback, monkeypatch):
    """Repeated prompts forwarded once under a 4-D mask, through the adapted layers and head."""
    from grpo_lightning.module import forward as forward_module
    from tests.module.test_shared_prefix_forward import make_grouped

    layouts = []
    original = forward_module.shared_prefix_layout
    monkeypatch.setattr(forward_module, "shared_prefix_layout", lambda *a, **k: layouts.append(original(*a, **k)) or layouts[-1])
    model = lora(tiny("llama", attn=attn), target_modules="all-linear", modules_to_save=["lm_head"])
    batch = make_grouped()
    want = reference(model, batch, entropy_coef=0.1)
    assert_same(run(model, batch, ForwardOptions(lm_head_chunk_tokens=4), entropy_coef=0.1), want, batch[3])
    assert len(layouts) == 1 and layouts[0] is not None, "the shared-prefix layout was not used"


@pytest.mark.parametrize("head", ["adapted-attention", "lora-on-lm_head", "lm_head-modules_to_save"])
def test_disabled_adapters_on_the_optimized_path_give_the_base_model(head, no_plain_fallback):
    base = tiny("llama", tie=False)
    want = reference(base, make_batch(), grad=False)  # before wrapping: the base model alone
    model = lora(base, **HEADS[head])
    batch = make_batch()
    with torch.no_grad():
        adapted = completion_logprobs(model, *batch[:4], TEMPERATURE, options=ForwardOptions())
        with model.disable_adapter():
            got = completion_logprobs(model, *batch[:4], TEMPERATURE, options=ForwardOptions())
    assert_same_values(got, want, batch[3])
    assert not torch.allclose(adapted[0][batch[3].bool()], got[0][batch[3].bool()], atol=1e-3)


def test_the_plain_path_skips_the_head_on_prompt_positions_through_the_peft_wrapper(monkeypatch):
    """PEFT passes ``logits_to_keep`` on to the model: the plain path asks for completion logits only."""
    model = lora(tiny("llama"), target_modules=["q_proj"])
    batch = make_batch()
    seen = []
    head = model.get_base_model().lm_head
    head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    with torch.no_grad():
        completion_logprobs(model, *batch[:4], TEMPERATURE, options=ForwardOptions.plain())
    assert seen == [batch[2].shape[1] + 1]


# ------------------------------------------------------------------ the module with peft_config
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("peft") / "model")


def test_kl_loss_with_lora_builds_no_reference_copy(model_dir):
    plain = built(GRPOModule(model_dir))
    module = built(GRPOModule(model_dir, loss=LOSSES["grpo"](beta=0.04), peft_config={"r": 4, "lora_alpha": 8}))
    assert module.ref_policy is None and module.needs_reference_logprobs
    adapter = sum(p.numel() for n, p in module.named_parameters() if "lora_" in n)
    assert sum(p.numel() for p in module.parameters()) == sum(p.numel() for p in plain.parameters()) + adapter
    assert [n for n, p in module.named_parameters() if p.requires_grad] == [
        n for n, _ in module.named_parameters() if "lora_" in n
    ]
    layer = module.policy.get_base_model().model.layers[0].self_attn.q_proj
    with module.reference_context() as ref:
        assert ref is module.policy and layer.disable_adapters
    assert not layer.disable_adapters


def test_reference_context_without_a_kl_term_raises(model_dir):
    module = built(GRPOModule(model_dir, peft_config=LoRASettings(r=2)))
    with pytest.raises(RuntimeError, match="beta == 0"):
        with module.reference_context():
            pass


def test_disable_dropout_reaches_the_adapters(model_dir):
    module = built(GRPOModule(model_dir, peft_config={"lora_dropout": 0.1}, disable_dropout=True))
    dropouts = [m for n, m in module.policy.named_modules() if "lora_dropout" in n and isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0.0 for m in dropouts)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(quantization_config={"load_in_4bit": True}), "quantization_config is set without model.peft_config"),
        (dict(peft_config={"target_modules": ["q_proj", "qq_proj"]}), r"target_modules: \['qq_proj'\] match no module"),
        (dict(peft_config={"target_modules": "model\\.nothing\\..*"}), "target_modules=.*matches no module"),
        (dict(peft_config={"modules_to_save": ["head"]}), r"modules_to_save: \['head'\]"),
        (dict(peft_config={"target_modules": []}), "name at least one module"),
        (dict(peft_config={"r": 0}), "peft_config.r=0"),
        (dict(peft_config={"lora_dropout": 1.0}), "lora_dropout=1.0"),
        (dict(peft_config={"rank": 8}), r"unknown key\(s\) \['rank'\]"),
        (dict(peft_config={}, quantization_config={"load_in_4bit": True, "load_in_8bit": True}), "exactly one"),
        (dict(peft_config={}, quantization_config={}), "exactly one"),
        (dict(peft_config={}, model_init_kwargs={"quantization_config": {}}), "set model.quantization_config instead"),
    ],
)
def test_bad_settings_fail_at_construction(model_dir, kwargs, match, monkeypatch):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ConfigError, match=match):
        GRPOModule(model_dir, **kwargs)


def test_a_peft_model_object_with_peft_config_is_refused(model_dir):
    model = lora(tiny("llama"), target_modules=["q_proj"])
    with pytest.raises(ConfigError, match="already a PeftModel"):
        GRPOModule(model, tokenizer=model_dir, peft_config=LoRASettings())
    with pytest.raises(ConfigError, match="load it quantized yourself"):
        GRPOModule(tiny("llama"), tokenizer=model_dir, peft_config=LoRASettings(),
                   quantization_config=QuantizationSettings(load_in_4bit=True))


def test_target_modules_of_a_model_object_are_checked(model_dir):
    with pytest.raises(ConfigError, match="match no module"):
        GRPOModule(tiny("llama"), tokenizer=model_dir, peft_config=LoRASettings(target_modules=["c_attn"]))


@pytest.mark.parametrize("package, extra, kwargs", [
    ("peft", "grpo-lightning[peft]", dict(peft_config={})),
    ("bitsandbytes", "grpo-lightning[quantization]", dict(peft_config={}, quantization_config={"load_in_4bit": True})),
])
def test_a_missing_extra_is_named(model_dir, monkeypatch, package, extra, kwargs):
    monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    with pytest.raises(ImportError, match=extra.replace("[", r"\[").replace("]", r"\]")):
        GRPOModule(model_dir, **kwargs)
