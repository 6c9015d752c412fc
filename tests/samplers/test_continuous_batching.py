"""ContinuousBatchingSampler on a tiny model: rollouts in prompt order, EOS handling, log-probs equal
to the policy's own (float64 recomputation, float32 error model of tests/numerics.py), the policy
left untouched, bf16 autocast reaching the engine's thread, the kept cache fresh after a weight
change, bounded default sizes, reproducible sampling."""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch

from grpo_lightning.module import GRPOModule
from grpo_lightning.samplers import get_sampler
from grpo_lightning.samplers.continuous_batching import ContinuousBatchingSampler, check_engine_version
from grpo_lightning.types import GenerationParams
from grpo_lightning.utils.checkpointing import is_activation_checkpointing
from grpo_lightning.utils.tiny_models import build_char_tokenizer, build_tiny_causal_lm
from tests.helpers import ALPHABET, built
from tests.module.test_forward_paths import perturbed, reduction_size
from tests.numerics import assert_close_f32

PROMPTS = ["1+2=", "33+4=", "7=", "12+12=", "a b c+"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cb") / "model"
    tokenizer = build_char_tokenizer(ALPHABET)
    model = perturbed(build_tiny_causal_lm(len(tokenizer), hidden_size=64, num_heads=4, num_kv_heads=2))  # head_dim 16
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def setup(model_dir, **sampler_kwargs):
    try:
        check_engine_version()
    except RuntimeError as error:  # the refusal itself is tested below
        pytest.skip(str(error))
    module = built(GRPOModule(model_dir, save_final_model=False))
    sampler = ContinuousBatchingSampler(**sampler_kwargs)
    sampler.bind(module)
    return module, sampler, [module.tokenizer(p)["input_ids"] for p in PROMPTS]


def policy_logprobs(policy, rollouts, temperature, top_k=0):
    """Per rollout: float64 ``log_softmax(logits / T)`` of the sampled tokens (over the top-k
    logits when ``top_k``), and the float32 error model (reduction size, scale) of its forward."""
    reference = copy.deepcopy(policy).double().eval()
    out = []
    with torch.no_grad():
        for r in rollouts:
            ids = torch.tensor([r.prompt_ids + r.completion_ids])
            logits = reference(ids).logits[0, len(r.prompt_ids) - 1 : -1] / temperature  # (T, V)
            if top_k:
                logits = logits.masked_fill(logits < logits.topk(top_k, -1).values[:, -1:], -torch.inf)
            logps = logits.log_softmax(-1).gather(1, torch.tensor(r.completion_ids)[:, None])[:, 0]
            out.append((logps, reduction_size(policy, ids.shape[1]), float(logits[logits.isfinite()].abs().max()) + 1.0))
    return out


def assert_own_logprobs(policy, rollouts, temperature, top_k=0):
    for i, (want, size, scale) in enumerate(policy_logprobs(policy, rollouts, temperature, top_k)):
        assert_close_f32(torch.tensor(rollouts[i].sampling_logprobs), want, reduction_size=size, scale=scale,
                         msg=f"rollout {i}")


def test_rollouts_in_prompt_order_with_sane_eos(model_dir):
    module, sampler, prompts = setup(model_dir)
    params = GenerationParams(max_completion_length=12)
    rollouts = sampler.generate(prompts, 3, params)
    assert [r.prompt_ids for r in rollouts] == [p for p in prompts for _ in range(3)]
    eos = set(module.eos_token_ids)
    for r in rollouts:
        assert 1 <= len(r.completion_ids) <= 12 and r.policy_version == module.policy_version == 0
        assert len(r.sampling_logprobs) == len(r.completion_ids)
        assert r.ended_on_eos == (r.completion_ids[-1] in eos)
        assert not eos & set(r.completion_ids[:-1]), "cut after the first EOS"
        assert r.ended_on_eos or len(r.completion_ids) == 12
    # Rig the policy to favour EOS (a bias on the LM head): completions stop early.
    policy = module.policy
    head = torch.nn.Linear(policy.lm_head.in_features, policy.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(policy.lm_head.weight)
        head.bias.zero_()
        head.bias[module.tokenizer.eos_token_id] = 6.0
    policy.lm_head = head
    rigged = sampler.generate(prompts, 4, params)
    assert sum(r.ended_on_eos for r in rigged) > len(rigged) // 2
    assert all(r.ended_on_eos == (r.completion_ids[-1] in eos) for r in rigged)
    assert sum(len(r.completion_ids) for r in rigged) / len(rigged) < 6
    assert_own_logprobs(policy, rigged, 1.0)
    sampler.close()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_are_the_policys_own(model_dir, temperature):
    module, sampler, prompts = setup(model_dir)
    rollouts = sampler.generate(prompts, 2, GenerationParams(max_completion_length=10, temperature=temperature))
    assert_own_logprobs(module.policy, rollouts, temperature)
    # With top-k they are the processed (truncated, renormalised) distribution's.
    rollouts = sampler.generate(prompts, 2, GenerationParams(max_completion_length=10, temperature=temperature, top_k=4))
    assert_own_logprobs(module.policy, rollouts, temperature, top_k=4)
    sampler.close()


def test_policy_left_untouched(model_dir):
    module, sampler, prompts = setup(model_dir)
    policy = module.policy
    policy.train()
    policy.model.layers[1].mlp.eval()  # a mixed-mode model keeps every module's own flag
    policy.model.embed_tokens.weight.requires_grad_(False)
    checkpointing = is_activation_checkpointing(policy)
    assert checkpointing, "GRPOModule enables gradient checkpointing by default"
    before = {n: (p.dtype, p.requires_grad, p.detach().clone()) for n, p in policy.named_parameters()}
    modes = {n: m.training for n, m in policy.named_modules()}
    attention, use_cache = policy.config._attn_implementation, policy.config.use_cache
    module.precision_context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # as under bf16-mixed
    sampler.generate(prompts, 2, GenerationParams(max_completion_length=6))
    for n, p in policy.named_parameters():
        dtype, requires_grad, value = before[n]
        assert (p.dtype, p.requires_grad) == (dtype, requires_grad) and torch.equal(p, value), n
    assert {n: m.training for n, m in policy.named_modules()} == modes
    assert is_activation_checkpointing(policy) == checkpointing
    assert (policy.config._attn_implementation, policy.config.use_cache) == (attention, use_cache)
    assert "forward" not in vars(policy) and "_cached_continuous_batching_manager" not in vars(policy)
    assert sampler.engine_config is not None  # the engine is kept by the sampler, not on the model
    copy.deepcopy(policy)  # so the policy can still be copied (a reference model, a checkpoint)
    sampler.close()


def test_bf16_autocast_reaches_the_engine(model_dir):
    """The engine runs the forward on its own thread, which the caller's (thread-local) autocast
    does not reach: the sampler enters the precision context there, and the bfloat16 keys/values
    are stored in the float32 cache."""
    module, sampler, prompts = setup(model_dir)
    module.precision_context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)
    seen = []
    hook = module.policy.lm_head.register_forward_hook(
        lambda mod, args, out: seen.append((out.dtype, threading.current_thread() is threading.main_thread()))
    )
    rollouts = sampler.generate(prompts, 2, GenerationParams(max_completion_length=8))
    hook.remove()
    assert seen and set(seen) == {(torch.bfloat16, False)}, set(seen)
    assert all(math.isfinite(x) and x <= 0 for r in rollouts for x in r.sampling_logprobs)
    assert {p.dtype for p in module.policy.parameters()} == {torch.float32}
    sampler.close()


def test_kept_cache_serves_new_weights(model_dir):
    # Pages of 4 tokens: the prompts fill whole pages, which the engine's prefix cache would share.
    module, sampler, prompts = setup(model_dir, continuous_batching_config={"page_size": 4})
    params = GenerationParams(max_completion_length=8)
    long_prompts = [p * 3 for p in prompts]
    assert_own_logprobs(module.policy, sampler.generate(long_prompts, 2, params), 1.0)
    manager = sampler._manager
    assert manager.batch_processor.cache.use_prefix_sharing
    with torch.no_grad():  # an optimizer step
        for p in module.policy.model.layers[0].parameters():
            p.mul_(3.0)
    rollouts = sampler.generate(long_prompts, 2, params)
    assert sampler._manager is manager, "the engine and its cache are reused"
    assert_own_logprobs(module.policy, rollouts, 1.0)  # no key/value of the old weights served
    sampler.generate(long_prompts, 2, GenerationParams(max_completion_length=8, temperature=0.5))
    assert sampler._manager is not manager, "other sampling settings: a new engine"
    sampler.close()
    assert sampler._manager is None and sampler.engine_config is None
    fresh = ContinuousBatchingSampler(keep_cache=False)
    fresh.bind(module)
    assert_own_logprobs(module.policy, fresh.generate(prompts, 2, params), 1.0)
    assert fresh._manager is None


def test_bounded_default_sizes(model_dir):
    module, sampler, prompts = setup(model_dir)
    rows = [p for p in prompts[:3] for _ in range(4)]  # prompts of 4, 5 and 2 tokens
    settings = sampler.engine_settings(rows, GenerationParams(max_completion_length=100))
    # rows x ceil((5 + 100) / 64) = 24 blocks -> 32; prompt tokens 44 -> 64
    assert settings == {"return_logprobs": True, "page_size": 64, "num_blocks": 32, "max_batch_tokens": 64}
    many = sampler.engine_settings([[5] * 300] * 64, GenerationParams(max_completion_length=20))
    assert many["max_batch_tokens"] == 4096 and many["num_blocks"] == 512
    sampler.generate(prompts[:3], 4, GenerationParams(max_completion_length=100))
    resolved = sampler.engine_config
    assert (resolved.page_size, resolved.max_batch_tokens) == (64, 64) and 32 <= resolved.num_blocks < 64
    manager = sampler._manager
    sampler.generate(prompts[:1], 2, GenerationParams(max_completion_length=100))
    assert sampler._manager is manager, "a smaller request fits the kept cache"
    sampler.generate(prompts, 16, GenerationParams(max_completion_length=100))
    assert sampler._manager is not manager and sampler.engine_config.num_blocks >= 80, "grown for 80 rows"
    sampler.close()
    user = ContinuousBatchingSampler({"num_blocks": 8, "page_size": 16, "max_batch_tokens": 32})
    user.bind(module)
    assert user.engine_settings(rows, GenerationParams()) == {"num_blocks": 8, "page_size": 16,
                                                              "max_batch_tokens": 32, "return_logprobs": True}
    auto = ContinuousBatchingSampler({"max_memory_percent": 0.5})
    auto.bind(module)
    assert auto.engine_settings(rows, GenerationParams()) == {"max_memory_percent": 0.5, "return_logprobs": True}


def test_seeded_sampling_and_the_global_rng(model_dir):
    _, sampler, prompts = setup(model_dir)
    params = GenerationParams(max_completion_length=10)
    torch.manual_seed(0)
    first = [r.completion_ids for r in sampler.generate(prompts, 4, params)]
    after = torch.rand(3)
    torch.manual_seed(0)
    assert [r.completion_ids for r in sampler.generate(prompts, 4, params)] == first
    torch.manual_seed(0)
    torch.randint(0, 2**62, (), dtype=torch.int64)  # the one draw a call takes from the global stream
    assert torch.equal(torch.rand(3), after), "the engine's reseeding does not leak into the training RNG"
    sampler.close()


def test_refusals(model_dir):
    module, sampler, prompts = setup(model_dir)
    with pytest.raises(ValueError, match="repetition_penalty"):
        sampler.generate(prompts, 2, GenerationParams(max_completion_length=4, repetition_penalty=1.2))
    with pytest.raises(ValueError, match="return_logprobs"):
        ContinuousBatchingSampler({"return_logprobs": False})
    module.tokenizer.image_processor = object()  # a vision-language processor
    with pytest.raises(ValueError, match="vision-language"):
        sampler.generate(prompts, 2, GenerationParams(max_completion_length=4))


def test_engine_failure_raises_and_restores_the_policy(model_dir):
    module, sampler, prompts = setup(model_dir)
    policy = module.policy.train()

    def boom(mod, args, out):
        raise RuntimeError("boom in the engine thread")

    hook = policy.lm_head.register_forward_hook(boom)
    with pytest.raises(RuntimeError, match="boom in the engine thread"):
        sampler.generate(prompts, 2, GenerationParams(max_completion_length=4))
    hook.remove()
    assert policy.training and "forward" not in vars(policy) and sampler._manager is None
    rollouts = sampler.generate(prompts, 2, GenerationParams(max_completion_length=4))  # a fresh engine
    assert len(rollouts) == 2 * len(prompts)
    sampler.close()


def test_registered_and_configurable_from_yaml(tmp_path):
    from grpo_lightning.data import RolloutDataModule
    from tests.test_configs import ParseOnly

    assert isinstance(get_sampler("continuous_batching"), ContinuousBatchingSampler)
    config = tmp_path / "cfg.yaml"
    config.write_text("""
model: {model: unused}
data:
  dataset: unused.jsonl
  reward_funcs: [exact_match_reward]
  sampler:
    class_path: grpo_lightning.samplers.continuous_batching.ContinuousBatchingSampler
    init_args: {continuous_batching_config: {num_blocks: 64, page_size: 32}, keep_cache: false}
""")
    cli = ParseOnly(GRPOModule, RolloutDataModule, run=False, args=["--config", str(config)])
    assert cli.config.data.sampler.init_args.continuous_batching_config == {"num_blocks": 64, "page_size": 32}


def test_an_engine_older_than_transformers_5_18_is_refused_by_name(monkeypatch):
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    monkeypatch.delattr(PagedAttentionCache, "reset", raising=False)  # as in transformers 5.17
    with pytest.raises(RuntimeError, match=r"needs transformers >= 5\.18 .*pip install -U 'transformers>=5\.18'"):
        ContinuousBatchingSampler().bind(None)
