"""Attention kernels of the packed forwards (``ForwardOptions.attention_kernel``) on CPU.

* the flex ``mask_mod``s equal the masks of the layouts exactly (document-causal for packing,
  the shared-prefix layout's own mask), and the ``BlockMask`` built from them keeps exactly the
  blocks holding a visible pair;
* ``varlen`` (on CPU: the same sequences through sdpa with the block-diagonal mask built from
  ``cu_seqlens``' sequence ids, reached through the installed dispatch) gives the plain path's
  float64 values and every parameter gradient, with and without gradient checkpointing;
* ``flex`` runs forward-only on CPU (torch has no CPU flex backward): no-grad values equal the
  plain path for packed and shared-prefix layouts; its gradients are checked on CUDA in
  ``test_attention_kernels_gpu.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from grpo_lightning.algo.block_masks import (
    block_mask,
    cu_seqlens,
    dense_mask,
    dense_mask_mod,
    document_causal_mask_mod,
    sequence_ids,
)
from grpo_lightning.algo.packing import packed_layout
from grpo_lightning.algo.shared_prefix import shared_prefix_layout
from grpo_lightning.module import attention_kernels
from grpo_lightning.module.attention_kernels import requested_kernel, resolve_kernel
from grpo_lightning.module.forward import ForwardOptions, completion_logprobs
from tests.module.test_forward_paths import (
    TEMPERATURE,
    assert_same,
    assert_same_values,
    make_batch,
    reference,
    run,
    tiny,
)
from tests.module.test_shared_prefix_forward import make_grouped

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _packed_dense(position_ids: torch.Tensor) -> torch.Tensor:
    """What transformers builds from restarting position ids, written out: (R, 1, W, W)."""
    rows, width = position_ids.shape
    mask = torch.zeros(rows, 1, width, width, dtype=torch.bool)
    for r in range(rows):
        start = 0
        for q in range(width):
            if position_ids[r, q] == 0:
                start = q
            mask[r, 0, q, start : q + 1] = True
    return mask


@pytest.mark.parametrize("row_tokens", [None, 10])
def test_document_mask_mod_equals_the_packed_mask(row_tokens):
    layout = packed_layout(*make_batch()[:4], row_tokens=row_tokens)
    rows, width = layout.input_ids.shape
    got = dense_mask(document_causal_mask_mod(sequence_ids(layout.position_ids)), rows, width)
    assert torch.equal(got, _packed_dense(layout.position_ids))


def test_cu_seqlens_are_the_packed_sequences():
    batch = make_batch()
    layout = packed_layout(*batch[:4])
    offsets, longest = cu_seqlens(layout.position_ids)
    real = (torch.cat(batch[1:2] + batch[3:4], 1).sum(1))[batch[3].sum(1) > 0]  # rows with a completion
    assert offsets.dtype == torch.int32 and offsets.tolist() == [0, *real.cumsum(0).tolist()]
    assert longest == int(real.max())


def test_dense_mask_mod_reproduces_the_shared_prefix_mask():
    layout = shared_prefix_layout(*make_grouped()[:4])
    rows, width = layout.input_ids.shape
    assert torch.equal(dense_mask(dense_mask_mod(layout.attention_mask), rows, width), layout.attention_mask)
    additive = shared_prefix_layout(*make_grouped()[:4], additive_mask=True).attention_mask
    assert torch.equal(dense_mask(dense_mask_mod(additive), rows, width), layout.attention_mask)


def test_block_mask_keeps_exactly_the_blocks_with_a_visible_pair():
    layout = packed_layout(*make_batch(prompt_lengths=(9, 3, 12, 4), completion_lengths=(7, 20, 5, 9))[:4])
    rows, width = layout.input_ids.shape
    mod = document_causal_mask_mod(sequence_ids(layout.position_ids))
    blocks = block_mask(mod, rows, width, "cpu", block_size=8).to_dense()  # (R, 1, nq, nk) 0/1
    dense = dense_mask(mod, rows, width)
    pad = (-width) % 8
    padded = torch.nn.functional.pad(dense, (0, pad, 0, pad))
    n = padded.shape[-1] // 8
    expected = padded.view(rows, 1, n, 8, n, 8).any(5).any(3)
    assert torch.equal(blocks.bool(), expected)


def test_resolution_per_device_and_layout(monkeypatch):
    assert [resolve_kernel(k, CPU, shared=False) for k in ("auto", "sdpa_mask", "flex", "varlen")] == [
        "sdpa_mask", "sdpa_mask", "flex", "varlen"]
    monkeypatch.setattr(attention_kernels, "varlen_supported", lambda: True)
    assert resolve_kernel("auto", CUDA, shared=False) == "varlen"
    monkeypatch.setattr(attention_kernels, "varlen_supported", lambda: False)  # torch 2.11's varlen_attn
    assert resolve_kernel("auto", CUDA, shared=False) == "flex" == resolve_kernel("varlen", CUDA, shared=False)
    assert resolve_kernel("varlen", CPU, shared=False) == "varlen"  # the CPU path (sdpa, block-diagonal mask)
    assert resolve_kernel("auto", CUDA, shared=True) == "flex" == resolve_kernel("varlen", CUDA, shared=True)
    assert requested_kernel("flex", "eager", None, CUDA) == "sdpa_mask"  # only sdpa is wrapped
    assert requested_kernel("auto", "sdpa", 4096, CUDA) == "sdpa_mask"  # a sliding window keeps its masks
    with pytest.raises(ValueError, match="forward.attention_kernel='flash'"):
        resolve_kernel("flash", CPU, shared=False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(attention_kernel="flash"), "attention_kernel='flash'.*auto, sdpa_mask, flex, varlen"),
    (dict(lm_head_chunk_tokens="fast"), "lm_head_chunk_tokens='fast'.*'auto'"),
    (dict(lm_head_chunk_tokens=True), "lm_head_chunk_tokens=True"),
])
def test_options_refuse_unknown_kernels_and_chunk_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ForwardOptions(**kwargs)


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of each kernel the dispatch makes."""
    calls = {"flex": 0, "varlen": 0}
    for name in calls:
        original = getattr(attention_kernels, f"_{name}")

        def spy(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(attention_kernels, f"_{name}", spy)
    return calls


@pytest.mark.parametrize("architecture, tie", [("llama", False), ("qwen2", True)])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_varlen_matches_plain_values_and_gradients(architecture, tie, checkpointing, kernel_calls, no_plain_fallback):
    model = tiny(architecture, tie=tie)
    if checkpointing:
        from grpo_lightning.utils.checkpointing import set_activation_checkpointing

        set_activation_checkpointing(model, True)
        model.train()
    batch = make_batch()
    want = reference(model, batch)
    options = ForwardOptions(attention_kernel="varlen", lm_head_chunk_tokens=4, share_prompt_prefix=False)
    assert_same(run(model, batch, options), want, batch[3])
    layers = model.config.num_hidden_layers
    assert kernel_calls["varlen"] == layers * (2 if checkpointing else 1)  # recompute goes through it too


def test_varlen_with_a_shared_prompt_takes_flex(kernel_calls):
    model = tiny("qwen2")
    batch = make_grouped()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex on CPU warns that it is unfused
        got = completion_logprobs(model, *batch[:4], TEMPERATURE, options=ForwardOptions(attention_kernel="varlen"))
    assert_same_values(got, reference(model, batch, grad=False), batch[3])
    assert kernel_calls == {"flex": model.config.num_hidden_layers, "varlen": 0}


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_flex_no_grad_matches_plain(share, architecture, kernel_calls):
    model = tiny(architecture)
    batch = make_grouped(seed=1) if share else make_batch(seed=1)
    options = ForwardOptions(attention_kernel="flex", share_prompt_prefix=share)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = completion_logprobs(model, *batch[:4], TEMPERATURE, options=options)
    assert_same_values(got, reference(model, batch, grad=False), batch[3])
    assert kernel_calls["flex"] == model.config.num_hidden_layers


def test_auto_on_cpu_is_the_mask_path(kernel_calls, no_plain_fallback):
    model = tiny("qwen2")
    batch = make_grouped()
    assert_same(run(model, batch, ForwardOptions(lm_head_chunk_tokens="auto")), reference(model, batch), batch[3])
    assert kernel_calls == {"flex": 0, "varlen": 0}


def test_plain_sdpa_calls_pass_through_the_dispatch_unchanged():
    attention_kernels.install()
    model = tiny("qwen2")
    batch = make_batch()
    want = reference(model, batch, grad=False)
    with torch.no_grad():  # the padded path with a 2-D mask: transformers' own sdpa masks
        got = completion_logprobs(model, *batch[:4], TEMPERATURE, options=ForwardOptions(padding_free=False))
    assert_same_values(got, want, batch[3])


def test_cli_parses_the_kernel_and_auto_chunks(tmp_path):
    from tests.module.test_module_forward_options import forward_options_from_cli

    forward = {"attention_kernel": "flex", "lm_head_chunk_tokens": "auto"}
    options = forward_options_from_cli(tmp_path, forward, "--model.forward.lm_head_chunk_tokens", "512")
    assert options == ForwardOptions(attention_kernel="flex", lm_head_chunk_tokens=512)
    assert forward_options_from_cli(tmp_path, forward).lm_head_chunk_tokens == "auto"


def _reference_varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, enable_gqa=False,
                           window_size=(-1, -1), **unused):
    """torch's varlen_attn contract written with sdpa, one sequence at a time: ``(T, H, D)``
    inputs, ``window_size=(-1, 0)`` causal, ``(-1, -1)`` full."""
    assert torch.equal(cu_q, cu_k) and max_q == max_k and cu_q.dtype == torch.int32
    assert int((cu_q[1:] - cu_q[:-1]).max()) == max_q and int(cu_q[-1]) == q.shape[0] == k.shape[0]
    assert window_size in ((-1, 0), (-1, -1)) and not unused
    out = torch.empty_like(q)
    for start, end in zip(cu_q[:-1].tolist(), cu_q[1:].tolist()):
        part = torch.nn.functional.scaled_dot_product_attention(
            q[start:end].transpose(0, 1), k[start:end].transpose(0, 1), v[start:end].transpose(0, 1),
            is_causal=window_size == (-1, 0), scale=scale, enable_gqa=enable_gqa,
        )
        out[start:end] = part.transpose(0, 1)
    return out


@pytest.mark.parametrize("architecture, tie", [("llama", False), ("qwen2", True)])
def test_flash_varlen_call_matches_plain(architecture, tie, monkeypatch, kernel_calls, no_plain_fallback):
    """The flash branch's plumbing (flattening, cu_seqlens, GQA, scale, causality, the output's
    shape) with torch's varlen_attn replaced by its contract written out, in float64 on CPU."""
    import torch.nn.attention.varlen as varlen

    monkeypatch.setattr(varlen, "varlen_attn", _reference_varlen_attn)
    monkeypatch.setattr(attention_kernels, "_flash_varlen_runs", lambda query, dropout: not dropout)
    model = tiny(architecture, tie=tie)
    assert model.config.num_key_value_heads < model.config.num_attention_heads  # GQA is exercised
    batch = make_batch(seed=2)
    want = reference(model, batch)
    options = ForwardOptions(attention_kernel="varlen", share_prompt_prefix=False, lm_head_chunk_tokens=5)
    assert_same(run(model, batch, options), want, batch[3])
    assert kernel_calls["varlen"] == model.config.num_hidden_layers


def _reference_flex_attention(q, k, v, *, block_mask, scale=None, enable_gqa=False, **unused):
    """flex_attention's contract with a ``BlockMask`` written with sdpa: its ``mask_mod`` on every
    pair (``(B, H, S, D)`` inputs)."""
    assert not unused
    rows, width = q.shape[0], q.shape[2]
    mask = dense_mask(block_mask.mask_mod, rows, width, q.device)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


@pytest.mark.parametrize("share", [False, True])
def test_flex_call_matches_plain_with_gradients(share, monkeypatch, kernel_calls, no_plain_fallback):
    """The flex branch's plumbing (the BlockMask it builds, GQA, scale, the output's layout) with
    gradients, flex_attention replaced by its contract (CPU has no flex backward), in float64."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "flex_attention", _reference_flex_attention)
    model = tiny("qwen2", tie=True)
    batch = make_grouped(seed=4) if share else make_batch(seed=4)
    want = reference(model, batch)
    options = ForwardOptions(attention_kernel="flex", share_prompt_prefix=share, lm_head_chunk_tokens=6)
    assert_same(run(model, batch, options), want, batch[3])
    assert kernel_calls["flex"] == model.config.num_hidden_layers


def test_flex_with_an_unsupported_head_size_runs_the_dense_mask(monkeypatch, kernel_calls, no_plain_fallback):
    monkeypatch.setattr(attention_kernels, "_flex_takes", lambda query: False)  # as a head_dim of 24 on CUDA
    model = tiny("qwen2", tie=True)
    batch = make_grouped(seed=5)
    assert_same(run(model, batch, ForwardOptions(attention_kernel="flex")), reference(model, batch), batch[3])
    assert kernel_calls["flex"] == 0
