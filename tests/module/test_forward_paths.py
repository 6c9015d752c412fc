"""The optimized log-prob forwards (chunked LM head, padding-free, token budget) give the plain
path's log-probs, entropies, loss and parameter gradients.

Each float32 path is compared with a float64 reference (a float64 copy of the model through the
plain padded forward, the log-softmax and the loss written out in float64), within the float32
rounding error of a forward through the model (``reduction_size`` and ``tests/numerics.py``).
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass

import pytest
import torch

from grpo_lightning.losses import LossInputs, get_loss
from grpo_lightning.module import forward as forward_module
from grpo_lightning.module import model_parts as model_parts_module
from grpo_lightning.module.forward import ForwardOptions, completion_logprobs
from grpo_lightning.utils.tiny_models import build_tiny_causal_lm
from tests.numerics import assert_close_f32

VOCAB = 61
TEMPERATURE = 0.7
PLAIN = ForwardOptions.plain()
OPTIMIZED = {
    "chunked": ForwardOptions(chunked_lm_head=True, padding_free=False, lm_head_chunk_tokens=5),
    "packed": ForwardOptions(chunked_lm_head=False, padding_free=True),
    "chunked+packed": ForwardOptions(lm_head_chunk_tokens=4),
    "chunked+packed-rows": ForwardOptions(lm_head_chunk_tokens=7, packed_row_tokens=10),
}


def make_batch(prompt_lengths=(6, 3, 1, 4, 2, 5), completion_lengths=(7, 2, 0, 5, 1, 3), seed=0, vocab=VOCAB):
    """Left-padded prompts and right-padded completions of varying lengths (one row empty)."""
    g = torch.Generator().manual_seed(seed)
    b, tp, t = len(prompt_lengths), max(prompt_lengths), max(completion_lengths)
    prompt_mask = (torch.arange(tp) >= tp - torch.tensor(prompt_lengths).unsqueeze(1)).long()
    completion_mask = (torch.arange(t) < torch.tensor(completion_lengths).unsqueeze(1)).long()
    prompt_ids = torch.randint(3, vocab, (b, tp), generator=g) * prompt_mask
    completion_ids = torch.randint(3, vocab, (b, t), generator=g) * completion_mask
    advantages = torch.randn(b, generator=g)
    return prompt_ids, prompt_mask, completion_ids, completion_mask, advantages


def perturbed(model, seed=1, scale=0.15):
    """Random weights of a larger spread than the init, so that differences would show."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


def tiny(architecture="llama", tie=False, attn="sdpa", hidden_size=32):
    model = build_tiny_causal_lm(VOCAB, architecture=architecture, tie_word_embeddings=tie, hidden_size=hidden_size)
    model.config._attn_implementation = attn
    return perturbed(model)


_PLAIN = forward_module._plain_logprobs  # the reference, even where a test patches the module's name
_PADDED = forward_module.padded_layout


def gemma2(attn, sliding_window=64):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, final_logit_softcapping=2.0, attn_logit_softcapping=None,
        sliding_window=sliding_window, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = perturbed(Gemma2ForCausalLM(config).float())
    model.config._attn_implementation = attn
    return model


def granite(attn):
    from transformers import GraniteConfig, GraniteForCausalLM

    config = GraniteConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, logits_scaling=3.0, max_position_embeddings=64, pad_token_id=0,
    )
    torch.manual_seed(0)
    model = perturbed(GraniteForCausalLM(config).float())
    model.config._attn_implementation = attn
    return model


def run(model, batch, options=None, *, entropy_coef=0.1, loss="dapo", old_logps=None):
    """Log-probs, entropies, loss and the flat parameter gradient of one micro-step
    (``options=None``: the plain path)."""
    prompt_ids, prompt_mask, completion_ids, completion_mask, advantages = batch
    model.zero_grad(set_to_none=True)
    if options is None:
        logps, entropies = _PLAIN(
            model, prompt_ids, prompt_mask, completion_ids, completion_mask, TEMPERATURE, True, entropy_coef != 0
        )
    else:
        logps, entropies = completion_logprobs(
            model, prompt_ids, prompt_mask, completion_ids, completion_mask, TEMPERATURE,
            entropy_requires_grad=entropy_coef != 0, options=options,
        )
    out = get_loss(loss)(
        LossInputs(
            logps=logps, old_logps=old_logps, advantages=advantages, mask=completion_mask, entropies=entropies,
            entropy_coef=entropy_coef, num_items_in_batch=completion_mask.sum().float(),
        )
    )
    out.loss.backward()
    grads = torch.cat([
        (p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()
    ])
    return logps.detach(), entropies.detach(), out.loss.detach(), grads


def reduction_size(model, width: int) -> int:
    """Sum of the reduction lengths on the path from the input embeddings to one log-prob, for
    the float32 error model of ``tests/numerics.py``: per decoder layer the input norm, the q/k/v
    projections, the scores (head size), the attention softmax and weighted sum over the
    ``width`` positions, the output projection, the second norm, the MLP's up/gate projections
    (hidden size) and its down projection (intermediate size); then the final norm, the LM head
    and the log-softmax over the vocabulary."""
    c = getattr(model, "module", model).config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_layer = 5 * c.hidden_size + head_dim + 2 * width + c.intermediate_size
    return c.num_hidden_layers * per_layer + 2 * c.hidden_size + c.vocab_size


@dataclass
class Reference:
    """What :func:`run` returns, computed in float64, with the error model of a float32 run."""

    logps: torch.Tensor
    entropies: torch.Tensor
    loss: torch.Tensor
    grads: torch.Tensor
    values_size: int  # reduction_size of a log-prob or entropy
    grads_size: int  # the backward repeats the forward's reductions and sums over the tokens
    logit_scale: float  # magnitude of what the last stages round: max |logit / T|, plus O(1) normed states
    loss_scale: float  # the logit scale times the loss's sensitivity to a log-prob: |ratio·A| + entropy_coef


def reference(
    model, batch, *, entropy_coef=0.1, loss="dapo", old_logps=None, grad=True, temperature=TEMPERATURE
) -> Reference:
    """:func:`run`'s plain path in float64: a float64 copy of the model (sdpa attention) on the
    padded batch, the log-softmax and entropy written out here, the loss on float64 inputs."""
    prompt_ids, prompt_mask, completion_ids, completion_mask, advantages = batch
    model64 = copy.deepcopy(getattr(model, "module", model)).double()
    model64.config._attn_implementation = "sdpa"
    input_ids = torch.cat([prompt_ids, completion_ids], 1)
    attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    width = completion_ids.shape[1]
    with torch.set_grad_enabled(grad):
        logits = model64(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        ).logits
        z = logits[:, -(width + 1) : -1] / temperature  # (B, T, V)
        log_norm = torch.logsumexp(z, -1)
        logps = z.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1) - log_norm
        with torch.set_grad_enabled(grad and entropy_coef != 0):
            entropies = log_norm - (torch.softmax(z, -1) * z).sum(-1)
        out = get_loss(loss)(
            LossInputs(
                logps=logps, old_logps=None if old_logps is None else old_logps.double(),
                advantages=advantages.double(), mask=completion_mask, entropies=entropies,
                entropy_coef=entropy_coef, num_items_in_batch=completion_mask.sum().double(),
            )
        )
    if grad:
        out.loss.backward()
    grads = torch.cat([
        (p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model64.parameters()
    ])
    mask = completion_mask.bool()
    size = reduction_size(model64, input_ids.shape[1])
    logit_scale = float(z.detach()[mask].abs().max()) + 1.0 if mask.any() else 1.0
    term_scale = 1.5 * float(advantages.abs().max()) + entropy_coef  # ratios stay within 1 ± 0.5 here
    return Reference(
        logps.detach(), entropies.detach(), out.loss.detach(), grads,
        values_size=size, grads_size=2 * size + int(mask.sum()),
        logit_scale=logit_scale, loss_scale=logit_scale * term_scale,
    )


def assert_same(got, want: Reference, mask):
    """``got`` (a float32 :func:`run`) equals the float64 reference ``want`` to float32 rounding."""
    mask = mask.bool()
    size, z = want.values_size, want.logit_scale
    assert_close_f32(got[0][mask], want.logps[mask], reduction_size=size, scale=z, msg="log-probs")
    assert_close_f32(got[1][mask], want.entropies[mask], reduction_size=size, scale=z, msg="entropies")
    assert_close_f32(got[2], want.loss, reduction_size=size, scale=want.loss_scale, msg="loss")
    # A gradient's error is relative (exp turns the logits' absolute error into the probabilities'
    # relative one), so its scale is the logits' times the gradient's magnitude.
    grad_scale = z * float(want.grads.abs().max())
    assert_close_f32(got[3], want.grads, reduction_size=want.grads_size, scale=grad_scale, msg="d loss / d params")


def assert_same_values(got, want: Reference, mask):
    """The no-grad pass: log-probs and entropies only."""
    mask = mask.bool()
    size, z = want.values_size, want.logit_scale
    assert_close_f32(got[0][mask], want.logps[mask], reduction_size=size, scale=z, msg="log-probs")
    assert_close_f32(got[1][mask], want.entropies[mask], reduction_size=size, scale=z, msg="entropies")


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("path", list(OPTIMIZED))
@pytest.mark.parametrize("entropy_coef", [0.0, 0.1], ids=["no-bonus", "entropy-bonus"])
def test_optimized_paths_match_plain(architecture, tie, path, entropy_coef, no_plain_fallback):
    model = tiny(architecture, tie)
    batch = make_batch()
    want = reference(model, batch, entropy_coef=entropy_coef)
    assert_same(run(model, batch, entropy_coef=entropy_coef), want, batch[3])  # the plain path itself
    got = run(model, batch, OPTIMIZED[path], entropy_coef=entropy_coef)
    assert_same(got, want, batch[3])
    # positions outside the completion mask hold 0
    assert not got[0][batch[3] == 0].any() and not got[1][batch[3] == 0].any()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("loss", ["grpo", "bnpo", "cispo"])
def test_packed_matches_plain_across_attention_and_losses(attn, loss, no_plain_fallback):
    model = tiny("qwen2", tie=True, attn=attn)
    batch = make_batch((2, 9, 4, 7), (9, 3, 6, 1), seed=3)
    with torch.no_grad():
        old = completion_logprobs(model, *batch[:4], TEMPERATURE, with_entropy=False, options=OPTIMIZED["chunked"])[0]
    old = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0)) * batch[3]
    want = reference(model, batch, loss=loss, old_logps=old)
    got = run(model, batch, OPTIMIZED["chunked+packed-rows"], loss=loss, old_logps=old)
    assert_same(got, want, batch[3])


def test_packed_rows_are_isolated_from_each_other(no_plain_fallback):
    """Changing one row's tokens changes no other row's log-probs in the packed forward."""
    model = tiny("llama")
    batch = make_batch()
    options = OPTIMIZED["chunked+packed"]
    with torch.no_grad():
        before = completion_logprobs(model, *batch[:4], TEMPERATURE, options=options)[0]
        changed = [t.clone() for t in batch[:4]]
        changed[0][0, -3:] = torch.tensor([5, 6, 7])  # row 0's prompt
        after = completion_logprobs(model, *changed, TEMPERATURE, options=options)[0]
    assert torch.equal(before[1:], after[1:])
    assert not torch.equal(before[0], after[0])


@pytest.mark.parametrize("budget", [1, 25, 60, 10_000])
@pytest.mark.parametrize("path", ["plain", "chunked+packed", "chunked"])
def test_token_budget_no_grad_pass_matches_and_keeps_row_order(budget, path):
    model = tiny("qwen2")
    batch = make_batch((6, 3, 1, 4, 2, 5, 2), (7, 2, 0, 5, 1, 3, 6), seed=5)
    base = PLAIN if path == "plain" else OPTIMIZED[path]
    options = ForwardOptions(
        chunked_lm_head=base.chunked_lm_head, padding_free=base.padding_free, logprob_token_budget=budget
    )
    with torch.no_grad():
        got = completion_logprobs(model, *batch[:4], TEMPERATURE, options=options)
    want = reference(model, batch, grad=False)
    assert got[0].shape == want.logps.shape
    assert_same_values(got, want, batch[3])


def test_token_budget_is_ignored_with_grad(no_plain_fallback):
    model = tiny("llama")
    batch = make_batch()
    options = ForwardOptions(logprob_token_budget=1)
    logps, _ = completion_logprobs(model, *batch[:4], TEMPERATURE, options=options)
    assert logps.requires_grad


def test_token_budget_groups_by_tokens(monkeypatch):
    model = tiny("llama")
    batch = make_batch((6, 3, 1, 4, 2, 5), (7, 2, 0, 5, 1, 3))
    calls = []
    original = forward_module._optimized_logprobs

    def spy(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *rest):
        calls.append((prompt_ids.shape, completion_ids.shape))
        return original(model, prompt_ids, prompt_mask, completion_ids, completion_mask, *rest)

    monkeypatch.setattr(forward_module, "_optimized_logprobs", spy)
    with torch.no_grad():
        options = ForwardOptions(padding_free=False, logprob_token_budget=24)
        completion_logprobs(model, *batch[:4], TEMPERATURE, options=options)
    assert len(calls) > 1
    assert all(p[0] * (p[1] + c[1]) <= 24 or p[0] == 1 for p, c in calls)
    assert sum(p[0] for p, _ in calls) == 6


def test_softcapping_model_matches_plain(no_plain_fallback):
    """Gemma 2: final logit soft-capping and sliding-window layers in the packed forward."""
    model = gemma2("sdpa", sliding_window=4)
    batch = make_batch()
    want = reference(model, batch)
    for options in OPTIMIZED.values():
        assert_same(run(model, batch, options), want, batch[3])


def test_logit_scaling_model_matches_plain(no_plain_fallback):
    """Granite divides its logits by ``logits_scaling``."""
    model = granite("sdpa")
    batch = make_batch()
    want = reference(model, batch)
    assert_same(run(model, batch, OPTIMIZED["chunked+packed"]), want, batch[3])


def test_unknown_architecture_falls_back_to_plain_with_a_log(monkeypatch, caplog):
    model = tiny("llama")
    monkeypatch.setattr(model_parts_module, "HEAD_MODEL_TYPES", set())
    monkeypatch.setattr(model_parts_module, "_logged", set())
    batch = make_batch()
    want, plain = reference(model, batch), run(model, batch)
    with caplog.at_level(logging.INFO, logger="grpo_lightning.module.forward"):
        got = run(model, batch, ForwardOptions())
    assert "not in grpo_lightning.module.model_parts.HEAD_MODEL_TYPES" in caplog.text
    assert_same(got, want, batch[3])
    # the plain path itself, padding positions (zeros) too
    assert_close_f32(got[0], plain[0], reduction_size=want.values_size, scale=want.logit_scale)


def test_unsupported_attention_keeps_chunked_head_on_padded_batch(monkeypatch, caplog):
    model = tiny("llama")
    batch = make_batch()
    want = reference(model, batch)
    monkeypatch.setattr(model_parts_module, "_logged", set())
    monkeypatch.setattr(forward_module, "_MASKED_ATTENTION", ())
    layouts = []
    monkeypatch.setattr(forward_module, "padded_layout", lambda *a, **k: layouts.append(1) or _PADDED(*a, **k))
    with caplog.at_level(logging.INFO, logger="grpo_lightning.module.forward"):
        got = run(model, batch, ForwardOptions())
    assert "Padding-free forward off" in caplog.text and layouts
    assert_same(got, want, batch[3])


def test_completion_after_empty_prompt_uses_the_padded_batch(monkeypatch, caplog):
    model = tiny("qwen2")
    batch = make_batch((0, 3, 2), (3, 2, 4))
    want = reference(model, batch)
    monkeypatch.setattr(model_parts_module, "_logged", set())
    with caplog.at_level(logging.INFO, logger="grpo_lightning.module.forward"):
        got = run(model, batch, ForwardOptions())
    assert "Padding-free forward skipped" in caplog.text
    assert_same(got, want, batch[3])


def test_all_masked_batch_keeps_a_graph():
    model = tiny("llama")
    batch = make_batch((2, 3), (0, 0))
    batch = (*batch[:3], torch.zeros_like(batch[3]), batch[4])
    logps, _ = completion_logprobs(model, *batch[:4], TEMPERATURE, options=ForwardOptions())
    assert logps.requires_grad and logps.shape == batch[2].shape


def test_wrapped_model_uses_hidden_states_through_the_wrapper(no_plain_fallback):
    """A DDP-style wrapper (``.module``) is called as a whole, never bypassed."""

    class Wrapper(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module
            self.calls = 0

        def forward(self, **kwargs):
            self.calls += 1
            return self.module(**kwargs)

    model = tiny("qwen2", tie=True)
    wrapper = Wrapper(model)
    batch = make_batch()
    want = reference(model, batch)
    for options in OPTIMIZED.values():
        calls = wrapper.calls
        got = run(wrapper, batch, options)
        assert wrapper.calls == calls + 1
        assert_same(got, want, batch[3])


def test_gradient_checkpointing_and_train_mode(no_plain_fallback):
    from grpo_lightning.utils.checkpointing import set_activation_checkpointing

    model = tiny("qwen2")
    set_activation_checkpointing(model, True)
    model.train()
    batch = make_batch()
    want = reference(model, batch)
    assert_same(run(model, batch, ForwardOptions(lm_head_chunk_tokens=3)), want, batch[3])


def test_default_call_is_the_optimized_path_and_plain_stays_selectable(monkeypatch):
    model = tiny("llama")
    batch = make_batch()
    ran = []
    monkeypatch.setattr(forward_module, "_plain_logprobs", lambda *a: ran.append("plain") or _PLAIN(*a))
    with torch.no_grad():
        completion_logprobs(model, *batch[:4], TEMPERATURE)
        assert ran == []
        completion_logprobs(model, *batch[:4], TEMPERATURE, options=ForwardOptions.plain())
    assert ran == ["plain"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lm_head_chunk_tokens=0), "lm_head_chunk_tokens"),
        (dict(packed_row_tokens=0), "packed_row_tokens"),
        (dict(logprob_token_budget=0), "logprob_token_budget"),
    ],
)
def test_options_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ForwardOptions(**kwargs)
