"""Autocast's weight-cast cache during generation (grpo_lightning/utils/weight_casts.py): under
Lightning's ``*-mixed`` autocast (cache off) each sampler casts every trainable weight once per
request instead of once per forward, produces the same tokens, and leaves no cached copy behind
(a stale copy would silently sample from the weights of before the last optimizer step)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_lightning.module import GRPOModule
from grpo_lightning.samplers import HFGenerateSampler
from grpo_lightning.samplers.fast_generate import FastGenerateSampler
from grpo_lightning.samplers.rollout_func import RolloutContext
from grpo_lightning.types import GenerationParams
from grpo_lightning.utils.memory_plan import MemorySettings, ModelShape, estimate_memory
from grpo_lightning.utils.weight_casts import reused_weight_casts
from tests.helpers import built, make_model_dir

PROMPTS = ["1+2=", "33+4=", "7="]
PARAMS = GenerationParams(max_completion_length=8)


def lightning_autocast():
    """What Lightning's ``MixedPrecision.forward_context()`` opens under ``bf16-mixed`` on CPU."""
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False)


class WeightCasts(TorchDispatchMode):
    """Counts the 16-bit copies made of ``weights`` (``aten._to_copy`` calls on them)."""

    def __init__(self, weights):
        super().__init__()
        self.pointers = {w.data_ptr() for w in weights}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.pointers:
            assert kwargs.get("dtype") == torch.bfloat16
            self.count += 1
        return func(*args, **kwargs)


class Forwards:
    """Counts the decoder's forward calls (one per prefill or decode step)."""

    def __init__(self, model):
        self.count = 0
        self._hook = model.model.register_forward_hook(lambda *a: setattr(self, "count", self.count + 1))

    def remove(self):
        self._hook.remove()


@pytest.fixture(scope="module")
def module(tmp_path_factory):
    module = built(GRPOModule(make_model_dir(tmp_path_factory.mktemp("casts") / "m", "qwen2"), save_final_model=False))
    module.precision_context = lightning_autocast
    return module


def linear_weights(model):
    return [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]


def sample(module, sampler, seed=0):
    """Completions of ``PROMPTS`` (2 each), the number of weight casts and of forward calls."""
    sampler.bind(module)
    prompts = [module.tokenizer(p)["input_ids"] for p in PROMPTS]
    forwards = Forwards(module.policy)
    torch.manual_seed(seed)
    try:
        with WeightCasts(linear_weights(module.policy)) as casts:
            rollouts = sampler.generate(prompts, 2, PARAMS)
    finally:
        forwards.remove()
    return [r.completion_ids for r in rollouts], casts.count, forwards.count


@pytest.mark.parametrize("sampler_class", [HFGenerateSampler, FastGenerateSampler])
def test_each_weight_is_cast_once_per_request_with_the_same_tokens(module, sampler_class):
    weights = len(linear_weights(module.policy))
    cached, cached_casts, cached_forwards = sample(module, sampler_class())
    plain, plain_casts, plain_forwards = sample(module, sampler_class(cache_weight_casts=False))
    assert cached == plain, "the cached copy is the copy each step would make: same logits, same draws"
    assert cached_forwards == plain_forwards > 2, "a prefill and several decode steps"
    assert cached_casts == weights, "one cast per trainable weight for the whole request"
    assert plain_casts == weights * plain_forwards, "without the cache: every weight at every forward"


def test_the_cache_is_empty_after_the_request(module):
    """A weight changed after a request (an optimizer step) is seen by the next request."""
    sampler = HFGenerateSampler()
    first, _, _ = sample(module, sampler)
    head = module.policy.lm_head.weight
    saved = head.detach().clone()
    try:
        with torch.no_grad():
            head.mul_(-4.0)  # in place: the same tensor, so a leftover cached copy would be reused
        changed, casts, _ = sample(module, sampler)
        assert casts == len(linear_weights(module.policy)), "every weight cast afresh"
        assert changed != first, "sampled from the updated head"
    finally:
        with torch.no_grad():
            head.copy_(saved)


def test_why_the_cache_must_be_emptied():
    """The hazard the context guards against: leaving a nested caching region keeps the copies, and
    a later caching region reuses them although the weight changed in place."""
    layer, x = torch.nn.Linear(4, 4), torch.randn(2, 4)
    with torch.no_grad(), lightning_autocast():
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
            before = layer(x)
        layer.weight.mul_(2.0)
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=True):
            assert torch.equal(layer(x), before), "stale: torch keeps nested regions' casts"
        torch.clear_autocast_cache()
        with reused_weight_casts("cpu"):
            before = layer(x)
        layer.weight.mul_(2.0)
        with reused_weight_casts("cpu"):
            assert not torch.equal(layer(x), before), "reused_weight_casts emptied the cache on exit"


def test_emptied_on_error_and_a_no_op_where_it_does_not_apply():
    layer, x = torch.nn.Linear(4, 4), torch.randn(2, 4)

    def casts(outer, enabled=True):
        """Casts of three forwards inside the context, under ``outer``."""
        with torch.no_grad(), outer, WeightCasts([layer.weight]) as counter:
            with reused_weight_casts("cpu", enabled):
                for _ in range(3):
                    layer(x)
            return counter.count

    assert casts(lightning_autocast()) == 1
    assert casts(lightning_autocast(), enabled=False) == 3, "opted out"
    assert casts(nullcontext()) == 0, "no autocast: fp32 weights, nothing to cast"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), WeightCasts([layer.weight]) as counter:
        layer(x)  # an enclosing region that caches already: its copy is reused, and kept
        with reused_weight_casts("cpu"):
            layer(x)
        layer(x)
        assert counter.count == 1, "the enclosing cache was left alone"
    with torch.no_grad(), lightning_autocast():
        with pytest.raises(RuntimeError, match="boom"), reused_weight_casts("cpu"):
            before = layer(x)
            raise RuntimeError("boom")
        layer.weight.mul_(2.0)
        with reused_weight_casts("cpu"):
            assert not torch.equal(layer(x), before), "emptied although the block raised"
        assert not torch.is_autocast_cache_enabled(), "Lightning's setting restored"


def test_rollout_function_context_casts_once(module):
    ctx = RolloutContext(module, 1, PARAMS)
    ids = torch.tensor([module.tokenizer("1+2=")["input_ids"]])
    with WeightCasts(linear_weights(module.policy)) as counter, ctx.generating():
        for _ in range(3):
            module.policy(input_ids=ids)
    assert counter.count == len(linear_weights(module.policy))


def test_memory_plan_counts_the_copies():
    shape = ModelShape(hidden_size=896, num_layers=24, intermediate_size=4864, vocab_size=151936, num_heads=14,
                       num_kv_heads=2, head_dim=64, tie_word_embeddings=True)
    settings = dict(trainable_parameters=494_000_000, generation_weight_casts=True)

    def line(**kw):
        plan = estimate_memory(shape, MemorySettings(**{**settings, **kw}))
        return next((x for x in plan.lines if x.name == "autocast 16-bit weight copies (generation)"), None)

    copies = line(precision="bf16-mixed")
    assert copies is not None and copies.bytes == 494_000_000 * 2 and copies.phase == "generation"
    assert line(precision="bf16-mixed", generation_weight_casts=False) is None, "sampler opted out"
    assert line(precision="32-true") is None and line(precision="bf16-true") is None, "no autocast casts"
    assert line(precision="bf16-mixed", sampler="vllm_colocate") is None, "the engine has its own weights"
