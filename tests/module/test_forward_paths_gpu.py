"""The optimized log-prob forwards on CUDA: sdpa and flex_attention packing, bf16 autocast.

Skipped without a CUDA device (``flex_attention`` has no CPU backward, so its packed path can
only be checked here).
"""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.module import forward as forward_module
from grpo_lightning.module.forward import ForwardOptions
from tests.module.test_forward_paths import OPTIMIZED, make_batch, run, tiny

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def cuda_only():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _to(batch, device):
    return tuple(t.to(device) for t in batch)


def _close(got, want, mask, rtol, atol):
    mask = mask.bool()
    torch.testing.assert_close(got[0][mask], want[0][mask], rtol=rtol, atol=atol)
    torch.testing.assert_close(got[1][mask], want[1][mask], rtol=rtol, atol=atol)
    torch.testing.assert_close(got[2], want[2], rtol=rtol, atol=atol)
    torch.testing.assert_close(got[3], want[3], rtol=rtol, atol=atol * 10)


@pytest.mark.parametrize("attn", ["sdpa", "eager", "flex_attention"])
@pytest.mark.parametrize("path", list(OPTIMIZED))
def test_fp32_paths_match_plain_on_cuda(attn, path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the plain path ran")

    model = tiny("qwen2", tie=True, attn=attn, hidden_size=64).cuda()  # flex needs head_dim >= 16
    batch = _to(make_batch(), "cuda")
    want = run(model, batch)
    monkeypatch.setattr(forward_module, "_plain_logprobs", refuse)
    got = run(model, batch, OPTIMIZED[path])
    _close(got, want, batch[3], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("path", ["chunked", "chunked+packed"])
def test_bf16_autocast_paths_match_plain_on_cuda(path):
    model = tiny("llama", tie=False).cuda()
    batch = _to(make_batch(), "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = run(model, batch)
        got = run(model, batch, OPTIMIZED[path])
    _close(got, want, batch[3], rtol=3e-2, atol=3e-2)


def test_chunked_head_peak_memory_is_bounded_on_cuda():
    """A 32k vocabulary, 2k completion tokens: the chunked head's peak stays far below the plain one."""
    from grpo_lightning.utils.tiny_models import build_tiny_causal_lm

    model = build_tiny_causal_lm(32_000, architecture="qwen2", hidden_size=64, tie_word_embeddings=True).cuda()
    batch = _to(make_batch((8,) * 16, (128,) * 16, vocab=32_000), "cuda")
    peaks = {}
    for name, options in {"plain": None, "chunked": ForwardOptions(lm_head_chunk_tokens=256)}.items():
        run(model, batch, options)  # warm-up, gradients allocated
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run(model, batch, options)
        peaks[name] = torch.cuda.max_memory_allocated() - base
    logits_bytes = 16 * 128 * 32_000 * 4
    assert peaks["plain"] > logits_bytes
    assert peaks["chunked"] < peaks["plain"] / 4, peaks
