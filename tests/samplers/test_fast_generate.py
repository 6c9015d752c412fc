"""FastGenerateSampler on tiny models: rollouts in prompt order, EOS and length limits, log-probs
equal to a float64 recomputation (float32 error model of tests/numerics.py), the distribution of
``hf_generate`` (chi-square against the exact processed distribution and against ``generate``'s
own samples), near-greedy agreement with ``generate`` token for token, the policy left untouched,
the oneDNN head's self-check, one draw from the global RNG, refused settings."""

from __future__ import annotations

import inspect
import copy
import math

import pytest
import torch

from grpo_lightning.module import GRPOModule
from grpo_lightning.samplers import HFGenerateSampler, get_sampler
from grpo_lightning.samplers.fast_generate import ExactDraw, FastGenerateSampler
from grpo_lightning.types import GenerationParams
from grpo_lightning.utils.checkpointing import is_activation_checkpointing
from grpo_lightning.utils.tiny_models import build_char_tokenizer, build_tiny_causal_lm
from tests.helpers import ALPHABET, built
from tests.module.test_forward_paths import perturbed
from tests.numerics import assert_close_f32
from tests.samplers.test_continuous_batching import assert_own_logprobs

PROMPTS = ["1+2=", "33+4=", "7=", "12+12=", "a b c+"]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"fast_{request.param}") / "model"
    tokenizer = build_char_tokenizer(ALPHABET)
    model = perturbed(build_tiny_causal_lm(len(tokenizer), architecture=request.param, hidden_size=64, num_heads=4,
                                           num_kv_heads=2))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def setup(model_dir, **sampler_kwargs):
    module = built(GRPOModule(model_dir, save_final_model=False))
    sampler = FastGenerateSampler(**sampler_kwargs)
    sampler.bind(module)
    return module, sampler, [module.tokenizer(p)["input_ids"] for p in PROMPTS]


def favour_eos(module, bias):
    """Give the LM head a bias row favouring EOS (a plain ``nn.Linear`` with bias)."""
    policy = module.policy
    head = torch.nn.Linear(policy.lm_head.in_features, policy.lm_head.out_features, bias=True)
    with torch.no_grad():
        head.weight.copy_(policy.lm_head.weight)
        head.bias.zero_()
        head.bias[module.tokenizer.eos_token_id] = bias
    policy.lm_head = head


@pytest.mark.parametrize("onednn_head", [True, False])
def test_rollouts_in_prompt_order_with_eos_and_length_limit(model_dir, onednn_head):
    module, sampler, prompts = setup(model_dir, onednn_head=onednn_head)
    params = GenerationParams(max_completion_length=12)
    eos = set(module.eos_token_ids)

    def check(rollouts, group):
        assert [r.prompt_ids for r in rollouts] == [p for p in prompts for _ in range(group)]
        for r in rollouts:
            assert 1 <= len(r.completion_ids) <= 12 and r.policy_version == module.policy_version == 0
            assert len(r.sampling_logprobs) == len(r.completion_ids)
            assert r.ended_on_eos == (r.completion_ids[-1] in eos)
            assert not eos & set(r.completion_ids[:-1]), "cut after the first EOS"
            assert r.ended_on_eos or len(r.completion_ids) == 12

    check(sampler.generate(prompts, 3, params), 3)
    favour_eos(module, 1.5)  # rows now end at different steps and leave the batch
    rigged = sampler.generate(prompts, 4, params)
    check(rigged, 4)
    lengths = [len(r.completion_ids) for r in rigged]
    assert sum(r.ended_on_eos for r in rigged) > len(rigged) // 2 and len(set(lengths)) >= 3
    assert_own_logprobs(module.policy, rigged, 1.0)
    chunked = FastGenerateSampler(max_batch_rows=3, onednn_head=onednn_head)
    chunked.bind(module)
    check(chunked.generate(prompts, 4, params), 4)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_logprobs_are_the_policys_own(model_dir, temperature):
    module, sampler, prompts = setup(model_dir)
    rollouts = sampler.generate(prompts, 2, GenerationParams(max_completion_length=10, temperature=temperature))
    assert_own_logprobs(module.policy, rollouts, temperature)
    # With top-k they are the processed (truncated, renormalised) distribution's.
    rollouts = sampler.generate(prompts, 2, GenerationParams(max_completion_length=10, temperature=temperature, top_k=4))
    assert_own_logprobs(module.policy, rollouts, temperature, top_k=4)


def _chi2_sf(x: float, k: int) -> float:
    """Survival function of the chi-square distribution (Wilson-Hilferty normal approximation,
    accurate to a few percent in the tail for ``k >= 10``)."""
    z = ((x / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def _exact_two_token_distribution(module, prompt, params):
    """P(first two completion tokens) of ``generate``'s processed distribution, in float64: the
    policy's logits through transformers' own logits processors for these settings."""
    from grpo_lightning.samplers.hf_common import build_generation_config

    policy = copy.deepcopy(module.policy).double().eval()
    config, _ = policy._prepare_generation_config(build_generation_config(module, params))
    policy._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=torch.device("cpu"))
    processors = policy._get_logits_processor(generation_config=config, input_ids_seq_length=len(prompt),
                                              encoder_input_ids=torch.tensor([prompt]), device="cpu", model_kwargs={})
    eos = module.tokenizer.eos_token_id

    def probs(ids):
        ids = torch.tensor([ids])
        with torch.no_grad():
            return processors(ids, policy(ids).logits[:, -1]).softmax(-1)[0]

    first = probs(prompt)
    out = {}
    for a in first.nonzero()[:, 0].tolist():
        if a == eos:
            out[(a,)] = float(first[a])
            continue
        second = probs(prompt + [a])
        for b in second.nonzero()[:, 0].tolist():
            out[(a, b)] = float(first[a] * second[b])
    return out


def _pooled_chi2(counts_a, counts_b_or_probs, n_a, n_b=None):
    """Chi-square statistic and degrees of freedom, cells with an expected count below 5 pooled.
    ``n_b=None``: goodness of fit of ``counts_a`` to the probabilities; else homogeneity of two samples."""
    cells = sorted(set(counts_a) | set(counts_b_or_probs))
    if n_b is None:
        expected = {c: n_a * counts_b_or_probs.get(c, 0.0) for c in cells}
        big = [c for c in cells if expected[c] >= 5]
        obs = [counts_a.get(c, 0) for c in big] + [sum(counts_a.get(c, 0) for c in cells if c not in big)]
        exp = [expected[c] for c in big] + [sum(expected[c] for c in cells if c not in big)]
        stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
        return stat, len(big)
    total = n_a + n_b
    pooled = {c: (counts_a.get(c, 0) + counts_b_or_probs.get(c, 0)) / total for c in cells}
    big = [c for c in cells if min(n_a, n_b) * pooled[c] >= 5]
    rest = lambda counts: sum(counts.get(c, 0) for c in cells if c not in big)  # noqa: E731
    rows = [[counts_a.get(c, 0) for c in big] + [rest(counts_a)], [counts_b_or_probs.get(c, 0) for c in big] + [rest(counts_b_or_probs)]]
    stat = 0.0
    for j in range(len(big) + 1):
        col = rows[0][j] + rows[1][j]
        for row, n in zip(rows, (n_a, n_b)):
            e = n * col / total
            stat += (row[j] - e) ** 2 / e if e > 0 else 0.0
    return stat, len(big)


@pytest.mark.parametrize("settings", [
    dict(),
    dict(temperature=0.7, top_k=6, top_p=0.9),
    dict(temperature=1.3, min_p=0.05, repetition_penalty=1.5),
])
def test_same_distribution_as_hf_generate(model_dir, settings):
    """Two tokens per row from one prompt, 3000 rows each: ours fits the exact processed
    distribution and is homogeneous with ``generate``'s samples. A wrong temperature or a
    missed truncation moves many cells by far more than the 1e-3 level tested here."""
    module, sampler, _ = setup(model_dir)
    favour_eos(module, 1.5)  # EOS is a likely first token: a one-token outcome in the table
    prompt = module.tokenizer("12+3=")["input_ids"]
    params = GenerationParams(max_completion_length=2, **settings)
    exact = _exact_two_token_distribution(module, prompt, params)
    assert math.isclose(sum(exact.values()), 1.0, rel_tol=1e-9)
    n = 3000
    torch.manual_seed(0)
    ours = [tuple(r.completion_ids) for r in sampler.generate([prompt], n, params)]
    hf = HFGenerateSampler()
    hf.bind(module)
    theirs = [tuple(r.completion_ids) for r in hf.generate([prompt], n, params)]
    count = lambda seq: {c: seq.count(c) for c in set(seq)}  # noqa: E731
    assert set(ours) <= set(exact), "only tokens the processors keep are drawn"
    stat, dof = _pooled_chi2(count(ours), exact, n)
    assert dof >= 10 and _chi2_sf(stat, dof) > 1e-3, (stat, dof)
    stat, dof = _pooled_chi2(count(ours), count(theirs), n, n)
    assert _chi2_sf(stat, dof) > 1e-3, (stat, dof)


def test_near_greedy_matches_generate_token_for_token(model_dir):
    """At a tiny temperature both samplers follow the argmax path: equal completions show the
    cache, positions, left padding and rows leaving the batch are ``generate``'s."""
    module, sampler, prompts = setup(model_dir)
    favour_eos(module, 1.0)
    params = GenerationParams(max_completion_length=16, temperature=1e-4)
    hf = HFGenerateSampler()
    hf.bind(module)
    ours = [r.completion_ids for r in sampler.generate(prompts, 2, params)]
    theirs = [r.completion_ids for r in hf.generate(prompts, 2, params)]
    assert ours == theirs
    assert len({len(c) for c in ours}) > 1, "rows of several lengths"


def test_policy_left_untouched_and_autocast(model_dir):
    module, sampler, prompts = setup(model_dir)
    policy = module.policy
    policy.train()
    policy.model.layers[1].mlp.eval()  # a mixed-mode model keeps every module's own flag
    checkpointing = is_activation_checkpointing(policy)
    assert checkpointing, "GRPOModule enables gradient checkpointing by default"
    before = {n: (p.dtype, p.requires_grad, p.detach().clone()) for n, p in policy.named_parameters()}
    modes = {n: m.training for n, m in policy.named_modules()}
    use_cache = policy.config.use_cache
    module.precision_context = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # as under bf16-mixed
    seen = []
    hook = policy.lm_head.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    rollouts = sampler.generate(prompts, 2, GenerationParams(max_completion_length=6))
    hook.remove()
    assert seen and set(seen) == {torch.bfloat16}, "the model's own head, under autocast, at every step"
    assert all(math.isfinite(x) and x <= 0 for r in rollouts for x in r.sampling_logprobs)
    for n, p in policy.named_parameters():
        dtype, requires_grad, value = before[n]
        assert (p.dtype, p.requires_grad) == (dtype, requires_grad) and torch.equal(p, value), n
    assert {n: m.training for n, m in policy.named_modules()} == modes
    assert is_activation_checkpointing(policy) == checkpointing and policy.config.use_cache == use_cache
    assert not policy._forward_hooks and not policy.model._forward_hooks


def test_onednn_head_checks_itself_against_the_models_logits(model_dir):
    """A model whose logits are not its head's output (here: scaled by a hook, as soft-capping or
    a logit scale would) is detected on the prefill; the rest of the call uses the model's own
    forward, so the log-probs are still the policy's."""
    module, sampler, prompts = setup(model_dir)
    hook = module.policy.lm_head.register_forward_hook(lambda mod, args, out: out * 2.0)
    calls = []
    counter = module.policy.register_forward_pre_hook(lambda mod, args: calls.append(1))
    rollouts = sampler.generate(prompts, 2, GenerationParams(max_completion_length=6))
    steps = max(len(r.completion_ids) for r in rollouts)
    assert steps > 1 and len(calls) == steps, "the full model at every step once the head did not reproduce its logits"
    assert_own_logprobs(module.policy, rollouts, 1.0)
    hook.remove()
    calls.clear()
    rollouts = sampler.generate(prompts, 2, GenerationParams(max_completion_length=6))
    assert len(calls) == 1, "prefill only: the decode steps use the decoder and the oneDNN head"
    counter.remove()
    assert_own_logprobs(module.policy, rollouts, 1.0)


def test_one_draw_from_the_global_rng(model_dir):
    _, sampler, prompts = setup(model_dir)
    params = GenerationParams(max_completion_length=10)
    torch.manual_seed(0)
    first = [r.completion_ids for r in sampler.generate(prompts, 4, params)]
    after = torch.rand(3)
    torch.manual_seed(0)
    assert [r.completion_ids for r in sampler.generate(prompts, 4, params)] == first
    torch.manual_seed(0)
    torch.randint(0, 2**62, (), dtype=torch.int64)  # the one draw a call takes from the global stream
    assert torch.equal(torch.rand(3), after)


def test_exact_draw_never_picks_a_zero_probability_token():
    """Truncated tokens (``-inf``) and the block padding are never drawn, also at the block edges,
    and the log-prob is the float64 ``log_softmax`` up to float32 rounding of the scores."""
    vocab = 2 * 1024 + 5  # three blocks, the last one mostly padding
    scores = torch.full((6, vocab), -torch.inf)
    allowed = [[0], [1023], [1024, 2047], [vocab - 1], [5, 2048, vocab - 1], list(range(0, vocab, 7))]
    g = torch.Generator().manual_seed(0)
    for row, ids in enumerate(allowed):
        scores[row, ids] = torch.randn(len(ids), generator=g) * 3
    draw = ExactDraw()
    for _ in range(200):
        ids, logps = draw(scores, g)
        assert all(int(i) in allowed[r] for r, i in enumerate(ids))
        want = scores.double().log_softmax(-1).gather(1, ids[:, None])[:, 0]
        assert_close_f32(logps, want, reduction_size=vocab, scale=float(scores[scores.isfinite()].abs().max()) + 1.0)
    with pytest.raises(RuntimeError, match="NaN"):
        draw(torch.full((2, vocab), float("nan")), g)


def test_refusals(model_dir):
    module, sampler, prompts = setup(model_dir)
    for kwargs, name in [({"num_beams": 2}, "num_beams"), ({"do_sample": False}, "do_sample"),
                         ({"guidance_scale": 1.5}, "ClassifierFreeGuidance"), ({"stop_strings": ["="]}, "stop_strings")]:
        with pytest.raises(ValueError, match=name):
            sampler.generate(prompts, 2, GenerationParams(max_completion_length=4, generation_kwargs=kwargs))
    with pytest.raises(ValueError, match="max_batch_rows"):
        FastGenerateSampler(max_batch_rows=0)
    assert isinstance(get_sampler("fast_generate"), FastGenerateSampler)
    assert FastGenerateSampler.provides_logprobs and not FastGenerateSampler.keeps_own_weights


def test_a_model_that_ignores_the_cache_is_refused(model_dir, monkeypatch):
    """The cache keyword follows transformers' spelling (``cache`` from 5.24, ``past_key_values``
    before); a forward that drops the cache would sample every later token without its context."""
    from grpo_lightning.samplers import fast_generate

    module, sampler, prompts = setup(model_dir)
    assert fast_generate.cache_keyword(module.policy) in inspect.signature(type(module.policy).forward).parameters
    monkeypatch.setattr(fast_generate, "cache_keyword", lambda model: "not_the_cache")
    with pytest.raises(RuntimeError, match="left the KV cache passed as not_the_cache= empty"):
        sampler.generate(prompts, 2, GenerationParams(max_completion_length=3))
