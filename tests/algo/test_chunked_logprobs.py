"""``chunked_head_logprobs`` equals log-softmax of the full logits, values and gradients.

References are computed in float64 (a float64 copy of the head and the hidden states, with the
log-softmax written out here), so each float32 result is held to its own rounding error
(``tests/numerics.py``): a linear head (``HIDDEN``-term dot products) then a ``VOCAB``-term
log-softmax, errors relative to the logits' magnitude; gradients add the sum over tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_lightning.algo.chunked_logprobs import chunked_head_logprobs
from grpo_lightning.algo.logprobs import token_logprobs_and_entropy
from tests.numerics import assert_close_f32

HIDDEN, VOCAB, TOKENS = 8, 37, 11


def _reference(hidden, ids, head, temperature, logit_scale=None, softcap=None, entropy_requires_grad=False):
    logits = head(hidden)
    if logit_scale is not None:
        logits = logits * logit_scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    lp, ent = token_logprobs_and_entropy(
        logits.unsqueeze(0), ids.unsqueeze(0), temperature, entropy_requires_grad=entropy_requires_grad
    )
    return lp[0], ent[0]


def _reference64(hidden, ids, head, temperature, logit_scale=None, softcap=None, entropy_requires_grad=False):
    """``(logps, entropies, max |logit / temperature|)`` in float64, written out independently of
    the code under test. ``hidden`` and ``head`` are float64 copies."""
    z = head(hidden)
    if logit_scale is not None:
        z = z * logit_scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    z = z / temperature  # (n, V)
    log_norm = torch.logsumexp(z, dim=-1)
    logps = z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - log_norm
    with torch.set_grad_enabled(entropy_requires_grad and torch.is_grad_enabled()):
        entropies = log_norm - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logps, entropies, float(z.detach().abs().max())


def _float64(head, h):
    """Float64 copies of the head and of the hidden states (a fresh leaf)."""
    return copy.deepcopy(head).double(), h.detach().double().requires_grad_(h.requires_grad)


def _assert_values(out, ref, logit_scale):
    """Log-probs and entropies: a ``HIDDEN``-term dot product then a ``VOCAB``-term log-sum-exp,
    errors relative to the logits."""
    assert_close_f32(out[0], ref[0], reduction_size=HIDDEN + VOCAB, scale=logit_scale, msg="log-probs")
    if out[1] is not None:
        assert_close_f32(out[1], ref[1], reduction_size=HIDDEN + VOCAB, scale=logit_scale, msg="entropies")


def _assert_grads(grads, ref_grads, logit_scale, tokens=TOKENS):
    """Gradients: the forward's error enters as a relative error ``eps·|z|`` of the probabilities,
    then the backward sums over the vocabulary (hidden states) or the tokens (weight, bias)."""
    for name, got, want in zip(("hidden", "weight", "bias"), grads, ref_grads):
        scale = logit_scale * float(want.abs().max())
        assert_close_f32(got, want, reduction_size=HIDDEN + VOCAB + tokens, scale=scale, msg=f"grad {name}")


class WrappedHead(torch.nn.Module):
    """A head that is not a bare ``nn.Linear`` (as an adapter-wrapped head): takes the
    checkpointed path."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x)


def _setup(seed=0, tokens=TOKENS, hidden=HIDDEN, vocab=VOCAB, bias=True):
    torch.manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=bias)
    with torch.no_grad():
        head.weight.mul_(8.0)  # peaked distributions, so mistakes show
    h = torch.randn(tokens, hidden, requires_grad=True)
    ids = torch.randint(0, vocab, (tokens,))
    return head, h, ids


def _grads(head, h, out, weights):
    head.zero_grad()
    h.grad = None
    total = (out[0] * weights[0]).sum()
    if out[1] is not None:
        total = total + (out[1] * weights[1]).sum()
    total.backward()
    return [h.grad.clone(), head.weight.grad.clone()] + ([head.bias.grad.clone()] if head.bias is not None else [])


@pytest.mark.parametrize("head_kind", ["linear", "module"])
@pytest.mark.parametrize("chunk_tokens", [1, 4, None])
@pytest.mark.parametrize("recompute", [True, False])
@pytest.mark.parametrize("entropy_requires_grad", [False, True])
@pytest.mark.parametrize(
    "transform", [dict(), dict(softcap=2.5), dict(logit_scale=0.3), dict(logit_scale=2.0, softcap=4.0)]
)
def test_matches_full_logits_values_and_gradients(head_kind, chunk_tokens, recompute, entropy_requires_grad, transform):
    head, h, ids = _setup()
    used = head if head_kind == "linear" else WrappedHead(head)
    temperature = 0.7
    weights = torch.randn(2, h.shape[0])
    head64, h64 = _float64(head, h)
    ref = _reference64(h64, ids, head64, temperature, entropy_requires_grad=entropy_requires_grad, **transform)
    ref_grads = _grads(head64, h64, (ref[0], ref[1] if entropy_requires_grad else None), weights.double())
    out = chunked_head_logprobs(
        h, ids, used, temperature, chunk_tokens=chunk_tokens, recompute=recompute,
        entropy_requires_grad=entropy_requires_grad, **transform,
    )
    assert out[0].dtype == torch.float32 and out[0].shape == ids.shape
    _assert_values(out, ref, ref[2])
    assert out[1].requires_grad == entropy_requires_grad
    grads = _grads(head, h, (out[0], out[1] if entropy_requires_grad else None), weights)
    _assert_grads(grads, ref_grads, ref[2])


def test_frozen_head_gets_no_gradient_and_hidden_still_does():
    head, h, ids = _setup()
    head.requires_grad_(False)
    head64, h64 = _float64(head, h)
    ref = _reference64(h64, ids, head64, 0.8)
    ref[0].sum().backward()
    lp, _ = chunked_head_logprobs(h, ids, head, 0.8, chunk_tokens=3)
    lp.sum().backward()
    assert head.weight.grad is None
    _assert_grads([h.grad], [h64.grad], ref[2])


def test_bf16_autocast_matches_the_autocast_reference():
    """Both sides run the head in bf16 under autocast and the log-softmax in float32: values agree
    to float32 rounding (both sides), gradients to bf16 rounding of the backward's inputs."""
    head, h, ids = _setup(vocab=50)
    weights = torch.randn(2, h.shape[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = head(h)
        lp, ent = token_logprobs_and_entropy(logits.unsqueeze(0), ids.unsqueeze(0), 0.9)
        ref = (lp[0], ent[0])
        out = chunked_head_logprobs(h, ids, head, 0.9, chunk_tokens=4)
    logit_scale = float((logits.float() / 0.9).abs().max())
    assert_close_f32(out[0], ref[0], reduction_size=HIDDEN + 50, scale=logit_scale, msg="log-probs")
    assert_close_f32(out[1], ref[1], reduction_size=HIDDEN + 50, scale=logit_scale, msg="entropies")
    # The backward multiplies bf16-rounded factors (relative error ≤ 2^-8 each, so ≤ eps_bf16 per
    # product) and accumulates in float32: a hard bound of eps_bf16 · Σ|terms| per side, where the
    # terms are the logit gradient g times the other factor: |g| |W|, |g|ᵀ |h|, Σ_t |g|.
    g = torch.autograd.grad((ref[0] * weights[0]).sum(), logits, retain_graph=True)[0].float().abs()  # (n, V)
    bounds = (g @ head.weight.detach().abs(), g.t() @ h.detach().abs(), g.sum(0))
    ref_grads = _grads(head, h, (ref[0], None), weights)
    grads = _grads(head, h, (out[0], None), weights)
    for name, got, want, bound in zip(("hidden", "weight", "bias"), grads, ref_grads, bounds):
        assert_close_f32(got, want, dtype=torch.bfloat16, scale=float(bound.max()), safety=1.0, msg=f"grad {name}")


def test_no_grad_and_no_entropy():
    head, h, ids = _setup(bias=False)
    head64, h64 = _float64(head, h)
    ref = _reference64(h64, ids, head64, 1.3)
    with torch.no_grad():
        lp, ent = chunked_head_logprobs(h, ids, head, 1.3, chunk_tokens=2, with_entropy=False, softcap=None)
    assert ent is None and not lp.requires_grad
    _assert_values((lp, None), ref, ref[2])
    with torch.no_grad():  # in-place transforms under no_grad
        lp, ent = chunked_head_logprobs(h, ids, head, 1.3, chunk_tokens=5, softcap=3.0, logit_scale=0.5)
    ref = _reference64(h64, ids, head64, 1.3, logit_scale=0.5, softcap=3.0)
    _assert_values((lp, ent), ref, ref[2])


def test_bf16_head_output_is_scored_in_fp32():
    """The bf16 head's logits are scored in float32: against the float64 log-softmax of the same
    bf16 logits, only float32 rounding of the softmax remains (bf16 scoring would be ~300x off)."""
    head, h, ids = _setup()
    head = head.to(torch.bfloat16)
    hb = h.detach().to(torch.bfloat16)
    lp, ent = chunked_head_logprobs(hb, ids, head, 0.9, chunk_tokens=4)
    ref = token_logprobs_and_entropy(head(hb).unsqueeze(0), ids.unsqueeze(0), 0.9)
    assert lp.dtype == torch.float32
    z = head(hb).double() / 0.9
    log_norm = torch.logsumexp(z, -1)
    ref64 = (z.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - log_norm, log_norm - (z.softmax(-1) * z).sum(-1))
    for got, want, want64, name in zip((lp, ent), ref, ref64, ("log-probs", "entropies")):
        assert_close_f32(got, want64, reduction_size=VOCAB, scale=float(z.abs().max()), msg=name)
        assert_close_f32(got, want[0], reduction_size=VOCAB, scale=float(z.abs().max()), msg=name)


def test_empty_and_bad_shapes():
    head, h, ids = _setup()
    lp, ent = chunked_head_logprobs(h[:0], ids[:0], head)
    assert lp.shape == (0,) and ent.shape == (0,)
    with pytest.raises(ValueError, match="hidden must be"):
        chunked_head_logprobs(h.unsqueeze(0), ids, head)


@pytest.mark.parametrize("head_kind", ["linear", "module"])
def test_backward_keeps_no_vocabulary_sized_activation(head_kind):
    """With recompute, autograd saves nothing of size V except the head's own parameters."""
    vocab = 1000
    head, h, ids = _setup(tokens=12, vocab=vocab)
    used = head if head_kind == "linear" else WrappedHead(head)
    params = {head.weight.data_ptr(), head.bias.data_ptr()}
    saved = []

    def pack(t):
        if t.data_ptr() not in params:
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_head_logprobs(h, ids, used, 0.8, chunk_tokens=4, recompute=True)
    assert all(vocab not in shape for shape in saved), saved
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_head_logprobs(h, ids, used, 0.8, chunk_tokens=4, recompute=False)
    assert any(vocab in shape for shape in saved)
