"""``model.router_aux_loss_coef`` (MoE load-balancing loss) and ``model.cast_lm_head_to_fp32``,
on tiny MoE (Qwen3-MoE, Mixtral) and dense (Llama) models built from configs."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from grpo_lightning.losses import DAPOLoss
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.fp32_head import FP32LMHead, cast_lm_head_to_fp32
from grpo_lightning.module.forward import ForwardOptions, completion_logprobs
from grpo_lightning.module.moe_aux import completion_logprobs_and_router_aux
from grpo_lightning.module.peft_settings import LoRASettings
from grpo_lightning.utils.tiny_models import build_char_tokenizer, build_tiny_causal_lm
from tests.helpers import ALPHABET, make_model_dir
from tests.module.test_entropy_selection import rollout_batch
from tests.module.test_forward_paths import make_batch, perturbed

VOCAB = 61
CHUNKED = ForwardOptions(chunked_lm_head=True, padding_free=False, lm_head_chunk_tokens=5)


def tiny_moe(architecture: str = "qwen3_moe", vocab: int = VOCAB, router_aux_loss_coef: float = 0.001):
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=128, pad_token_id=0,
                  bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, router_aux_loss_coef=router_aux_loss_coef)
    if architecture == "mixtral":
        config, cls = MixtralConfig(num_local_experts=4, **common), MixtralForCausalLM
    else:
        config, cls = Qwen3MoeConfig(num_experts=4, moe_intermediate_size=16, decoder_sparse_step=1, **common), \
            Qwen3MoeForCausalLM
    torch.manual_seed(0)
    return perturbed(cls(config).float())


def moe_model_dir(path, architecture="qwen3_moe", router_aux_loss_coef=0.001) -> str:
    tokenizer = build_char_tokenizer(ALPHABET)
    tiny_moe(architecture, len(tokenizer), router_aux_loss_coef).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def attach_fake_trainer(module: GRPOModule) -> GRPOModule:
    module.configure_model()
    module._trainer = SimpleNamespace(world_size=1, training=True, accumulate_grad_batches=1)
    return module


# --------------------------------------------------------------------------- router aux loss
@pytest.mark.parametrize("architecture", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("options", [ForwardOptions.plain(), CHUNKED, ForwardOptions()], ids=["plain", "chunked", "default"])
def test_router_aux_forward_matches_the_models_own_loss(architecture, options):
    model = tiny_moe(architecture)
    prompt_ids, prompt_mask, completion_ids, completion_mask, _ = make_batch()
    logps, entropies, aux = completion_logprobs_and_router_aux(
        model, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7, options=options)
    aux.backward()
    router_grad = model.model.layers[0].mlp.gate.weight.grad.clone()
    model.zero_grad()
    want_logps, want_entropies = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                                     0.7, options=ForwardOptions.plain())
    mask = completion_mask.bool()
    torch.testing.assert_close(logps[mask], want_logps[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropies[mask], want_entropies[mask], rtol=1e-5, atol=1e-5)
    # TRL's value: the model's forward on the padded batch with output_router_logits
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    want = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                 output_router_logits=True, use_cache=False).aux_loss
    want.backward()
    torch.testing.assert_close(aux, want.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(router_grad, model.model.layers[0].mlp.gate.weight.grad, rtol=1e-5, atol=1e-7)


def test_the_module_adds_coef_times_aux_over_accumulation_and_logs_aux_loss(tmp_path):
    path = moe_model_dir(tmp_path / "moe", router_aux_loss_coef=0.02)
    batch = rollout_batch()
    plain = attach_fake_trainer(GRPOModule(path, router_aux_loss_coef=0.0, forward=ForwardOptions.plain(),
                                           save_final_model=False))
    assert plain.loss_terms.router_aux_loss_coef == 0.0 and "aux_loss" not in plain._policy_loss(batch, None).metrics
    default = attach_fake_trainer(GRPOModule(path, forward=ForwardOptions.plain(), save_final_model=False))
    assert default.loss_terms.router_aux_loss_coef == 0.02  # None: the model config's value
    module = attach_fake_trainer(GRPOModule(path, router_aux_loss_coef=0.5, forward=ForwardOptions.plain(),
                                            save_final_model=False))
    module._trainer.accumulate_grad_batches = 2
    batch.accumulation_steps = 2
    out = module._policy_loss(batch, None)
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
    attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
    aux = module.policy(input_ids=input_ids, attention_mask=attention_mask,
                        position_ids=(attention_mask.cumsum(-1) - 1).clamp(min=0), output_router_logits=True).aux_loss
    base = module.loss(module_inputs(module, batch))  # the same micro-step without the router term
    assert float(out.loss) == pytest.approx(float(base.loss) + 0.5 * float(aux) / 2, rel=1e-5)
    assert out.metrics["aux_loss"].local() == pytest.approx(float(aux), rel=1e-5)


def module_inputs(module, batch):
    """The loss inputs of ``batch`` without the router term (plain forward, no aux)."""
    from grpo_lightning.module.training_forward import ScoredBatch, loss_inputs

    logps, entropies = completion_logprobs(module.policy, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                           batch.completion_mask, batch.temperature, options=ForwardOptions.plain())
    return loss_inputs(batch, ScoredBatch(logps, entropies), 1, batch.accumulation_steps or 1, 0.0, None)


def test_router_coefficient_on_a_dense_model_is_refused(tmp_path):
    dense = make_model_dir(tmp_path / "dense")
    with pytest.raises(ValueError, match=r"model.router_aux_loss_coef=0.01 is set, but the model \(llama\) is not a "
                                         r"Mixture-of-Experts model.*remove the setting \(null\)"):
        GRPOModule(dense, router_aux_loss_coef=0.01)
    assert GRPOModule(dense).loss_terms.router_aux_loss_coef == 0.0  # null on a dense model: off
    with pytest.raises(ValueError, match="router_aux_loss_coef=inf"):
        GRPOModule(moe_model_dir(tmp_path / "moe"), router_aux_loss_coef=float("inf"))


@pytest.mark.slow
def test_a_moe_run_logs_aux_loss(tmp_path):
    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.types import GenerationParams
    from tests.helpers import length_reward, write_prompts

    module = GRPOModule(moe_model_dir(tmp_path / "moe"), learning_rate=1e-2, save_final_model=False)
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, generation=GenerationParams(max_completion_length=4))
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path))
    trainer.fit(module, data)
    assert module.step_metrics["aux_loss"] > 0


# --------------------------------------------------------------------------- fp32 LM head
def test_cast_head_is_float32_and_stays_float32_through_dtype_conversions():
    model = cast_lm_head_to_fp32(build_tiny_causal_lm(VOCAB).to(torch.bfloat16))
    assert isinstance(model.lm_head, FP32LMHead) and type(model.lm_head).forward is torch.nn.Linear.forward
    model.to(torch.bfloat16)  # what Lightning's bf16-true precision does after configure_model
    assert model.lm_head.weight.dtype == torch.float32
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert set(model.state_dict()) == set(build_tiny_causal_lm(VOCAB).state_dict())  # same names: same checkpoints
    hidden = torch.randn(3, 32, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.lm_head(hidden)
    assert out.dtype == torch.float32
    expected = hidden.double() @ model.lm_head.weight.double().t()
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)  # an fp32 matmul, not bf16


def test_chunked_head_path_computes_in_float32_like_the_plain_path():
    model = cast_lm_head_to_fp32(perturbed(build_tiny_causal_lm(VOCAB)))
    prompt_ids, prompt_mask, completion_ids, completion_mask, _ = make_batch()
    args = (model, prompt_ids, prompt_mask, completion_ids, completion_mask, 0.7)
    head_dtypes = []
    hook = model.lm_head.register_forward_hook(lambda module, inputs, output: head_dtypes.append(output.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain, _ = completion_logprobs(*args, options=ForwardOptions.plain())
        chunked, _ = completion_logprobs(*args, options=CHUNKED)
        packed, _ = completion_logprobs(*args, options=ForwardOptions(chunked_lm_head=False, padding_free=True))
    hook.remove()
    mask = completion_mask.bool()
    # the same bf16 hidden states through the same fp32 head: equal to float32 rounding
    torch.testing.assert_close(chunked[mask], plain[mask], rtol=1e-5, atol=2e-5)
    # Packed rows run the bf16 decoder on other shapes, whose kernels round differently (which
    # ones depends on the CPU: AVX2 and AVX-512 differ), so only the head's own precision is
    # exact there: it computed in float32 on the packed path too; the log-probs agree to bf16.
    assert head_dtypes == [torch.float32, torch.float32]  # the plain and the packed pass (chunked reads the weight)
    torch.testing.assert_close(packed[mask], plain[mask], rtol=0.0, atol=8 * 2.0**-8 * float(plain[mask].abs().max()))
    fp32_gap = float((chunked[mask] - plain[mask]).abs().max())
    model.lm_head.__class__ = torch.nn.Linear  # a bf16 head matmul: bf16 rounding (2^-8 relative) shows
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16_head, _ = completion_logprobs(*args, options=CHUNKED)
    assert float((bf16_head[mask] - plain[mask]).abs().max()) > 20 * max(fp32_gap, 1e-6)


def test_module_casts_policy_and_reference_heads(tmp_path):
    module = GRPOModule(make_model_dir(tmp_path / "m"), cast_lm_head_to_fp32=True, dtype="bfloat16",
                        loss=DAPOLoss(beta=0.1))
    module.configure_model()
    for model in (module.policy, module.ref_policy):
        assert model.lm_head.weight.dtype == torch.float32
        assert model.model.embed_tokens.weight.dtype == torch.bfloat16


def test_tied_embeddings_and_an_adapted_head_are_refused(tmp_path):
    tokenizer = build_char_tokenizer(ALPHABET)
    tied = build_tiny_causal_lm(len(tokenizer), tie_word_embeddings=True)
    tied.save_pretrained(tmp_path / "tied")
    tokenizer.save_pretrained(tmp_path / "tied")
    match = r"model.cast_lm_head_to_fp32=true needs separate input and output embeddings.*tie_word_embeddings"
    with pytest.raises(ValueError, match=match):
        GRPOModule(str(tmp_path / "tied"), cast_lm_head_to_fp32=True)
    with pytest.raises(ValueError, match=match):
        cast_lm_head_to_fp32(tied)
    GRPOModule(str(tmp_path / "tied"))  # without the setting: fine
    with pytest.raises(ValueError, match="adapter on lm_head"):
        GRPOModule(make_model_dir(tmp_path / "m"), cast_lm_head_to_fp32=True,
                   peft_config=LoRASettings(modules_to_save=["lm_head"]))


@pytest.mark.slow
def test_bf16_true_training_keeps_the_head_float32(tmp_path):
    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.types import GenerationParams
    from tests.helpers import length_reward, write_prompts

    module = GRPOModule(make_model_dir(tmp_path / "m"), cast_lm_head_to_fp32=True, learning_rate=1e-2,
                        save_final_model=False)
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], num_generations=4,
                             per_device_train_batch_size=8, generation=GenerationParams(max_completion_length=4))
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", precision="bf16-true", logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         default_root_dir=str(tmp_path))
    trainer.fit(module, data)
    assert module.policy.lm_head.weight.dtype == torch.float32
    assert module.policy.model.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.isfinite(torch.tensor(module.step_metrics["loss"]))
