"""``chunked_head_logprobs`` equals log-softmax of the full logits, values and gradients."""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.algo.chunked_logprobs import chunked_head_logprobs
from grpo_lightning.algo.logprobs import token_logprobs_and_entropy


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


class WrappedHead(torch.nn.Module):
    """A head that is not a bare ``nn.Linear`` (as an adapter-wrapped head): takes the
    checkpointed path."""

    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return self.linear(x)


def _setup(seed=0, tokens=11, hidden=8, vocab=37, bias=True):
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
    ref = _reference(h, ids, head, temperature, entropy_requires_grad=entropy_requires_grad, **transform)
    ref_grads = _grads(head, h, (ref[0], ref[1] if entropy_requires_grad else None), weights)
    out = chunked_head_logprobs(
        h, ids, used, temperature, chunk_tokens=chunk_tokens, recompute=recompute,
        entropy_requires_grad=entropy_requires_grad, **transform,
    )
    assert out[0].dtype == torch.float32 and out[0].shape == ids.shape
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-5)
    assert out[1].requires_grad == entropy_requires_grad
    grads = _grads(head, h, (out[0], out[1] if entropy_requires_grad else None), weights)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_frozen_head_gets_no_gradient_and_hidden_still_does():
    head, h, ids = _setup()
    head.requires_grad_(False)
    ref = _reference(h, ids, head, 0.8)
    ref[0].sum().backward()
    want, h.grad = h.grad.clone(), None
    lp, _ = chunked_head_logprobs(h, ids, head, 0.8, chunk_tokens=3)
    lp.sum().backward()
    assert head.weight.grad is None
    torch.testing.assert_close(h.grad, want, rtol=1e-5, atol=1e-5)


def test_bf16_autocast_matches_the_autocast_reference():
    head, h, ids = _setup(vocab=50)
    weights = torch.randn(2, h.shape[0])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _reference(h, ids, head, 0.9)
        out = chunked_head_logprobs(h, ids, head, 0.9, chunk_tokens=4)
    torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1], ref[1], rtol=1e-5, atol=1e-5)
    ref_grads = _grads(head, h, (ref[0], None), weights)
    grads = _grads(head, h, (out[0], None), weights)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_no_grad_and_no_entropy():
    head, h, ids = _setup(bias=False)
    ref = _reference(h, ids, head, 1.3)
    with torch.no_grad():
        lp, ent = chunked_head_logprobs(h, ids, head, 1.3, chunk_tokens=2, with_entropy=False, softcap=None)
    assert ent is None and not lp.requires_grad
    torch.testing.assert_close(lp, ref[0], rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # in-place transforms under no_grad
        lp, ent = chunked_head_logprobs(h, ids, head, 1.3, chunk_tokens=5, softcap=3.0, logit_scale=0.5)
    ref = _reference(h, ids, head, 1.3, logit_scale=0.5, softcap=3.0)
    torch.testing.assert_close(lp, ref[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref[1], rtol=1e-5, atol=1e-5)


def test_bf16_head_output_is_scored_in_fp32():
    head, h, ids = _setup()
    head = head.to(torch.bfloat16)
    hb = h.detach().to(torch.bfloat16)
    lp, ent = chunked_head_logprobs(hb, ids, head, 0.9, chunk_tokens=4)
    ref = token_logprobs_and_entropy(head(hb).unsqueeze(0), ids.unsqueeze(0), 0.9)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, ref[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref[1][0], rtol=1e-5, atol=1e-5)


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
