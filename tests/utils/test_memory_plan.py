"""The memory estimator on a hand-sized model: every line against numbers worked out by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest

from grpo_lightning.utils.memory_plan import MemorySettings, ModelShape, estimate_memory, layer_activation_bytes
from grpo_lightning.utils.memory_report import format_plan, memory_warning, remedies

# h=8, L=2, i=16, V=10, 2 heads (1 KV head) of 4: q=8, kv=4.
SHAPE = ModelShape(hidden_size=8, num_layers=2, intermediate_size=16, vocab_size=10, num_heads=2, num_kv_heads=1, head_dim=4)
# A layer: q 8·8 + k,v 2·8·4 + o 8·8 + MLP 3·8·16 + two norms 2·8 = 64+64+64+384+16 = 592.
# Model: 2·592 + final norm 8 + embedding 10·8 + untied head 10·8 = 1352.
P = 1352


def settings(**kw) -> MemorySettings:
    base = dict(trainable_parameters=P, rows=2, prompt_length=5, completion_length=7, generation_rows=3,
                lm_head_chunk_tokens=4, gradient_checkpointing=False)
    return MemorySettings(**{**base, **kw})


def test_parameter_count_from_shape():
    assert SHAPE.layer_parameters == 592
    assert SHAPE.num_parameters == P
    assert replace(SHAPE, tie_word_embeddings=True).num_parameters == P - 80
    assert replace(SHAPE, attention_bias=True).layer_parameters == 592 + 8 + 2 * 4


def test_persistent_lines_fp32_adamw():
    plan = estimate_memory(SHAPE, settings())
    assert plan.line("policy weights").bytes == P * 4
    assert plan.line("gradients").bytes == P * 4
    assert plan.line("optimizer states").bytes == P * 8  # exp_avg + exp_avg_sq, fp32
    assert plan.persistent == P * 16
    assert not any(line.name == "reference model" for line in plan.lines)
    assert estimate_memory(SHAPE, settings(reference=True)).line("reference model").bytes == P * 4


def test_optimizers_and_precision():
    assert estimate_memory(SHAPE, settings(optimizer="adamw_8bit")).line("optimizer states").bytes == P * 2
    assert estimate_memory(SHAPE, settings(optimizer="sgd_momentum")).line("optimizer states").bytes == P * 4
    assert estimate_memory(SHAPE, settings(optimizer="sgd")).line("optimizer states").bytes == 0
    true16 = estimate_memory(SHAPE, settings(precision="bf16-true"))
    assert true16.line("policy weights").bytes == P * 2 and true16.line("optimizer states").bytes == P * 4
    mixed = estimate_memory(SHAPE, settings(precision="bf16-mixed"))
    assert mixed.line("policy weights").bytes == P * 4  # fp32 master weights, autocast
    assert mixed.line("autocast 16-bit weight copies").bytes == P * 2


def test_peft_counts_only_adapters_for_gradients_and_states():
    plan = estimate_memory(SHAPE, settings(trainable_parameters=100, frozen_parameters=P))
    assert plan.line("policy weights").bytes == (P + 100) * 4
    assert plan.line("gradients").bytes == 400 and plan.line("optimizer states").bytes == 800


@pytest.mark.parametrize(
    "strategy, divided",
    [("ddp", ()), ("fsdp2", ("policy weights", "gradients", "optimizer states")),
     ("deepspeed_stage_1", ("optimizer states",)), ("deepspeed_stage_2", ("gradients", "optimizer states"))],
)
def test_sharding_divides_by_world_size(strategy, divided):
    one = estimate_memory(SHAPE, settings())
    four = estimate_memory(SHAPE, settings(strategy=strategy, world_size=4))
    for name in ("policy weights", "gradients", "optimizer states"):
        # DeepSpeed's optimizer states are fp32 whatever the weights; here they are fp32 anyway.
        expected = one.line(name).bytes // 4 if name in divided else one.line(name).bytes
        assert four.line(name).bytes == expected, name
    assert any(line.name == "DDP gradient buckets" for line in four.lines) == (strategy == "ddp")


def test_layer_activations_by_hand():
    # 6h fp32 residual tensors + (5q + 4kv + 2q repeated k/v + 4i) fp32 + one lse per head.
    assert layer_activation_bytes(SHAPE, settings(), seq=12) == 6 * 8 * 4 + (40 + 16 + 16 + 64) * 4 + 2 * 4
    tokens = 2 * 12
    plan = estimate_memory(SHAPE, settings())
    final = tokens * 2 * 8 * 4 + 2 * 7 * 8 * 4  # final norm, completion hidden states for the head
    assert plan.line("activations (training)").bytes == tokens * 2 * 744 + final
    ckpt = estimate_memory(SHAPE, settings(gradient_checkpointing=True))
    assert ckpt.line("activations (training)").bytes == tokens * (2 * 8 * 4 + 744) + final


def test_chunked_head_bounds_the_logits():
    # 2 rows x 7 completion tokens = 14; chunked: 2 x min(4, 14) x 10 x 4 B + the (V, h) fp32 weight-gradient
    # product; plain: 4 fp32 copies, 14 x 10 x 16 B.
    chunked = 2 * 4 * 10 * 4 + 10 * 8 * 4
    assert estimate_memory(SHAPE, settings()).line("LM head logits (training)").bytes == chunked
    assert estimate_memory(SHAPE, settings(entropy_grad=True)).line("LM head logits (training)").bytes == chunked + 4 * 10 * 4
    assert estimate_memory(SHAPE, settings(chunked_lm_head=False)).line("LM head logits (training)").bytes == 14 * 10 * 16
    big = estimate_memory(SHAPE, settings(rows=64)).line("LM head logits (training)").bytes
    assert big == chunked  # independent of the batch


def test_kv_cache_formula():
    # 3 rows x (5 + 7) tokens x 2 layers x (k, v) x 4 (1 KV head of 4) x 4 B.
    assert estimate_memory(SHAPE, settings()).line("KV cache (generation)").bytes == 3 * 12 * 2 * 2 * 4 * 4
    assert estimate_memory(SHAPE, settings(precision="bf16-mixed")).line("KV cache (generation)").bytes == 3 * 12 * 2 * 2 * 4 * 2
    assert not any("KV" in line.name for line in estimate_memory(SHAPE, settings(sampler="external")).lines)


def test_train_token_budget_bounds_activations_in_whole_rows():
    full = estimate_memory(SHAPE, settings(rows=8)).line("activations (training)").bytes
    two_rows = estimate_memory(SHAPE, settings(rows=8, train_token_budget=30)).line("activations (training)").bytes
    assert two_rows * 4 == full  # 30 tokens hold 2 rows of 12: a quarter of the 8 rows
    tiny = estimate_memory(SHAPE, settings(rows=8, train_token_budget=1)).line("activations (training)").bytes
    assert tiny * 8 == full  # a row longer than the budget is a part of its own


def test_vllm_share_and_sleep_mode():
    gib = 2**30
    plan = estimate_memory(SHAPE, settings(sampler="vllm_colocate", vllm_gpu_memory_utilization=0.3, device_bytes=10 * gib))
    line = plan.line("vLLM engine (weights + KV cache)")
    assert line.bytes == 3 * gib and line.phase == "persistent"
    asleep = estimate_memory(SHAPE, settings(sampler="vllm_colocate", vllm_sleep_mode=True, device_bytes=10 * gib))
    assert asleep.line("vLLM engine (weights + KV cache)").phase == "generation"


@pytest.mark.parametrize("field, low, high", [("rows", 2, 8), ("completion_length", 7, 70), ("prompt_length", 5, 50)])
def test_monotone(field, low, high):
    for chunked in (True, False):
        small = estimate_memory(SHAPE, settings(chunked_lm_head=chunked, **{field: low})).total
        large = estimate_memory(SHAPE, settings(chunked_lm_head=chunked, **{field: high})).total
        assert large > small
    assert estimate_memory(SHAPE, settings(gradient_checkpointing=True)).total < estimate_memory(SHAPE, settings()).total


QWEN_05B = ModelShape(896, 24, 4864, 151_936, 14, 2, 64, tie_word_embeddings=True, attention_bias=True)


def test_warning_names_the_setting_that_fits():
    s = MemorySettings(trainable_parameters=QWEN_05B.num_parameters, rows=8, prompt_length=256, completion_length=1024,
                       gradient_checkpointing=False, chunked_lm_head=True)
    plan = estimate_memory(QWEN_05B, s)
    assert plan.peak_phase == "training"
    device = int(plan.persistent * 1.1 + plan.phase_bytes("training") * 0.5)
    warning = memory_warning(plan, device, "cuda:0")
    assert warning is not None and "exceeds" in warning
    first = remedies(plan, int(0.9 * device))[0]
    assert "gradient_checkpointing on" in first.setting and first.fits(int(0.9 * device))
    assert "model.gradient_checkpointing" in warning.splitlines()[1]
    assert memory_warning(plan, plan.total * 2, "cuda:0") is None


def test_warning_for_batch_and_vllm():
    s = MemorySettings(trainable_parameters=QWEN_05B.num_parameters, rows=32, prompt_length=256, completion_length=1024,
                       gradient_checkpointing=True, chunked_lm_head=True)
    plan = estimate_memory(QWEN_05B, s)
    warning = memory_warning(plan, int(plan.total * 0.8), "cuda:0")
    assert "train_token_budget" in warning and "per_device_train_batch_size" in warning
    gib = 2**30
    vllm = estimate_memory(QWEN_05B, replace(s, rows=2, sampler="vllm_colocate", vllm_gpu_memory_utilization=0.9,
                                             device_bytes=16 * gib))
    assert "gpu_memory_utilization" in memory_warning(vllm, 16 * gib, "cuda:0")


def test_table_lists_every_line_and_the_total():
    plan = estimate_memory(SHAPE, settings(reference=True, logprob_rows=2))
    table = format_plan(plan, 2**30, "cpu")
    for line in plan.lines:
        assert line.name in table
    assert "total:" in table and "(peak phase)" in table


def test_gradients_dropped_before_generation_count_only_in_training_and_the_step():
    # Generation the peak phase: 400 rows of KV cache (400 x 12 x 2 x 2 x 4 x 4 B = 307,200 B).
    upper = estimate_memory(SHAPE, settings(generation_rows=400))
    dropped = estimate_memory(SHAPE, settings(generation_rows=400, gradients_at_generation=False))
    grads = P * 4
    assert upper.line("gradients").phase == "persistent" and dropped.line("gradients").phase == "backward to step"
    assert upper.peak_phase == dropped.peak_phase == "generation"
    assert dropped.persistent == upper.persistent - grads
    assert dropped.total == upper.total - grads == dropped.persistent + dropped.phase_bytes("generation")
    for phase in ("training", "optimizer step"):  # the backward allocates them; the step applies them
        assert dropped.phase_total(phase) == upper.phase_total(phase)
    assert dropped.phase_total("generation") == upper.phase_total("generation") - grads
    table = format_plan(dropped)
    assert "[backward to step]" in table and "gradients" in table
    # Training the peak: nothing changes, and the total names the gradients it adds.
    train_peak = estimate_memory(SHAPE, settings(gradients_at_generation=False))
    assert train_peak.peak_phase == "training" and train_peak.total == estimate_memory(SHAPE, settings()).total
    assert "+ backward to step" in format_plan(train_peak).splitlines()[-1]


def test_deepspeed_keeps_its_gradient_buffers_through_generation():
    plan = estimate_memory(SHAPE, settings(strategy="deepspeed_stage_2", world_size=2, gradients_at_generation=False))
    assert plan.line("gradients").phase == "persistent"
