"""The weights a vLLM push sends (``vllm_common.policy_weights``): checkpoint names whatever wraps
the policy, LoRA merged for the push and unmerged after (also on an error), FSDP2 shards gathered
whole; ``policy_weight_shapes`` announces the same tensors without gathering."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_lightning.samplers.vllm_common import policy_weight_shapes, policy_weights
from grpo_lightning.utils.tiny_models import build_tiny_causal_lm


def test_wrappers_are_invisible_in_the_names() -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    reference = build_tiny_causal_lm(16, seed=1).state_dict()
    model = build_tiny_causal_lm(16, seed=1)
    layer_class = type(model.model.layers[0])
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, layer_class))
    compiled = torch.compile(model)  # lazy: nothing is compiled until called
    assert all(k.startswith("_orig_mod.") for k in compiled.state_dict())
    handle = SimpleNamespace(policy=compiled)
    with policy_weights(handle) as weights:
        got = dict(weights)
    assert list(got) == list(reference) == [n for n, _, _ in policy_weight_shapes(handle)]
    assert all(torch.equal(got[n], reference[n]) for n in reference)


@pytest.fixture
def lora_model():
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'grpo-lightning[peft]')")
    base = build_tiny_causal_lm(16, seed=2)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                             modules_to_save=["lm_head"])
    return peft.get_peft_model(base, config)


def test_lora_is_merged_for_the_push_under_base_names_and_unmerged_after(lora_model) -> None:
    import copy

    merged = copy.deepcopy(lora_model).merge_and_unload().state_dict()
    ids = torch.tensor([[1, 2, 3, 4]])
    before = lora_model(input_ids=ids).logits.detach()
    handle = SimpleNamespace(policy=lora_model)
    with policy_weights(handle) as weights:
        got = {name: tensor.clone() for name, tensor in weights}
    assert set(got) == set(merged)  # base checkpoint names: no lora_A/B, base_layer, modules_to_save
    for name, tensor in merged.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=1e-6)
    assert not torch.equal(got["model.layers.0.self_attn.q_proj.weight"],
                           lora_model.get_base_model().model.layers[0].self_attn.q_proj.base_layer.weight)
    torch.testing.assert_close(lora_model(input_ids=ids).logits, before, rtol=0, atol=1e-6)  # unmerged again
    assert [n for n, _, _ in policy_weight_shapes(handle)] == list(got)


def test_lora_is_unmerged_when_the_push_fails(lora_model) -> None:
    ids = torch.tensor([[1, 2, 3]])
    before = lora_model(input_ids=ids).logits.detach()
    with pytest.raises(RuntimeError, match="transport broke"):
        with policy_weights(SimpleNamespace(policy=lora_model)) as weights:
            next(iter(weights))
            raise RuntimeError("transport broke")
    torch.testing.assert_close(lora_model(input_ids=ids).logits, before, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_fsdp2_shards_are_gathered_whole_on_every_rank(tmp_path: Path) -> None:
    from tests.gloo_ranks import run_two_ranks

    run_two_ranks(Path(__file__).with_name("fsdp2_weights_child.py"), tmp_path)
