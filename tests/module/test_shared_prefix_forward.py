"""The shared-prefix forward (``share_prompt_prefix``): rows with the same prompt forward it once,
and log-probs, entropies, loss and every parameter gradient equal the plain path's (its float64
reference, to float32 rounding: ``tests/module/test_forward_paths.py``)."""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.module import forward as forward_module
from grpo_lightning.module.forward import ForwardOptions, completion_logprobs
from grpo_lightning.module.model_parts import decoder_cost, model_parts
from tests.algo.test_shared_prefix import grouped_batch
from tests.module.test_forward_paths import (
    TEMPERATURE,
    VOCAB,
    assert_same,
    assert_same_values,
    gemma2,
    granite,
    reference,
    run,
    tiny,
)

# Two groups of repeated prompts of different lengths, a unique prompt, a row without completion.
GROUPS = ((6, (4, 2, 7)), (3, (1, 5, 3)), (5, (3,)), (4, (2, 0)))
SHARED = {
    "chunked": ForwardOptions(lm_head_chunk_tokens=4),
    "unchunked-rows": ForwardOptions(chunked_lm_head=False, packed_row_tokens=12),
}
UNSHARED = ForwardOptions(share_prompt_prefix=False)


def make_grouped(groups=GROUPS, seed=0):
    batch = grouped_batch(groups, seed=seed, vocab=VOCAB)
    advantages = torch.randn(batch[0].shape[0], generator=torch.Generator().manual_seed(seed))
    return (*batch, advantages)


MODELS = {
    "llama": lambda attn: tiny("llama", attn=attn),
    "qwen2-tied": lambda attn: tiny("qwen2", tie=True, attn=attn),
    "gemma2": gemma2,
    "granite": granite,
}


@pytest.fixture
def shared_layouts(monkeypatch):
    """Records the shared-prefix layouts the forward builds (``None`` where it fell back)."""
    built = []
    original = forward_module.shared_prefix_layout

    def spy(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(forward_module, "shared_prefix_layout", spy)
    return built


@pytest.mark.parametrize("architecture", list(MODELS))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("path", list(SHARED))
def test_shared_prefix_matches_plain(architecture, attn, path, shared_layouts, no_plain_fallback):
    model = MODELS[architecture](attn)
    batch = make_grouped()
    want = reference(model, batch)
    got = run(model, batch, SHARED[path])
    assert len(shared_layouts) == 1 and shared_layouts[0] is not None
    expected_dtype = torch.float32 if attn == "eager" else torch.bool
    assert shared_layouts[0].attention_mask.dtype == expected_dtype
    assert_same(got, want, batch[3])
    assert not got[0][batch[3] == 0].any() and not got[1][batch[3] == 0].any()


@pytest.mark.parametrize("loss", ["grpo", "cispo"])
def test_shared_prefix_matches_plain_with_old_logprobs(loss, shared_layouts, no_plain_fallback):
    model = tiny("qwen2", attn="sdpa")
    batch = make_grouped(seed=3)
    with torch.no_grad():
        old = completion_logprobs(model, *batch[:4], TEMPERATURE, with_entropy=False, options=UNSHARED)[0]
    old = old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0)) * batch[3]
    want = reference(model, batch, loss=loss, old_logps=old)
    assert_same(run(model, batch, ForwardOptions(), loss=loss, old_logps=old), want, batch[3])
    assert shared_layouts and shared_layouts[0] is not None


@pytest.mark.parametrize("architecture", list(MODELS))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_no_grad_pass_matches_plain(architecture, attn, shared_layouts):
    model = MODELS[architecture](attn)
    batch = make_grouped(seed=1)
    with torch.no_grad():
        got = completion_logprobs(model, *batch[:4], TEMPERATURE, options=ForwardOptions())
    assert_same_values(got, reference(model, batch, grad=False), batch[3])
    assert shared_layouts[0] is not None


@pytest.mark.parametrize("budget", [1, 30, 10_000])
def test_token_budget_groups_match_plain(budget, shared_layouts):
    model = tiny("llama", attn="sdpa")
    batch = make_grouped(seed=2)
    with torch.no_grad():
        got = completion_logprobs(model, *batch[:4], TEMPERATURE, options=ForwardOptions(logprob_token_budget=budget))
    assert_same_values(got, reference(model, batch, grad=False), batch[3])
    shared = [lay for lay in shared_layouts if lay is not None]
    assert bool(shared) == (budget > 1)  # a one-row group has nothing to share


def _forwarded_tokens(model, batch, options):
    """Real (non-pad) and total tokens through the input embedding in one no-grad pass."""
    counts = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: counts.append((int((args[0] != 0).sum()), args[0].numel()))
    )
    try:
        with torch.no_grad():
            completion_logprobs(model, *batch[:4], TEMPERATURE, options=options)
    finally:
        hook.remove()
    assert len(counts) == 1
    return counts[0]


def test_shared_forward_runs_fewer_tokens():
    model = tiny("llama", attn="sdpa")
    batch = make_grouped()
    real_shared, total_shared = _forwarded_tokens(model, batch, ForwardOptions())
    real_unshared, total_unshared = _forwarded_tokens(model, batch, UNSHARED)
    # rows with a completion: group 1 shares its 6-token prompt 3×, group 2 its 3-token prompt 3×
    assert real_unshared - real_shared == 2 * 6 + 2 * 3
    assert real_unshared == int(batch[1][batch[3].any(1)].sum() + batch[3].sum())
    assert total_shared < total_unshared


def test_without_repeated_prompts_the_unshared_layout_runs(shared_layouts, no_plain_fallback):
    model = tiny("llama", attn="sdpa")
    batch = make_grouped(((6, (4,)), (3, (1,)), (5, (3,))))
    assert_same(run(model, batch, ForwardOptions()), reference(model, batch), batch[3])
    assert shared_layouts == [None]


def test_sliding_window_shorter_than_a_unit_falls_back(shared_layouts, no_plain_fallback):
    """Gemma 2 with a 4-token window: no unit fits, so the unshared packing runs (and matches)."""
    model = gemma2("sdpa", sliding_window=4)
    batch = make_grouped()
    assert_same(run(model, batch, ForwardOptions()), reference(model, batch), batch[3])
    assert shared_layouts == [None]


def test_sliding_window_caps_the_rows(shared_layouts, no_plain_fallback):
    """A window between the largest unit and the whole batch: rows stay within it, values match."""
    model = gemma2("eager", sliding_window=20)
    batch = make_grouped()
    assert_same(run(model, batch, ForwardOptions(packed_row_tokens=1000)), reference(model, batch), batch[3])
    assert shared_layouts[0] is not None and shared_layouts[0].input_ids.shape[1] <= 20


def test_varlen_attention_keeps_unshared_packing(monkeypatch, shared_layouts):
    """flash/flex implementations never get the 4-D mask."""
    monkeypatch.setattr(forward_module, "_MASKED_ATTENTION", ())
    monkeypatch.setattr(forward_module, "_VARLEN_ATTENTION", ("sdpa",))
    model = tiny("llama", attn="sdpa")
    with torch.no_grad():
        completion_logprobs(model, *make_grouped()[:4], TEMPERATURE, options=ForwardOptions())
    assert shared_layouts == []


def test_gradient_checkpointing_and_train_mode(shared_layouts, no_plain_fallback):
    from grpo_lightning.utils.checkpointing import set_activation_checkpointing

    model = tiny("qwen2", attn="sdpa")
    set_activation_checkpointing(model, True)
    model.train()
    batch = make_grouped()
    assert_same(run(model, batch, ForwardOptions(lm_head_chunk_tokens=3)), reference(model, batch), batch[3])
    assert shared_layouts[0] is not None


def test_option_defaults():
    assert ForwardOptions().share_prompt_prefix is True
    assert ForwardOptions.plain().share_prompt_prefix is False


@pytest.mark.gpu
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bf16_autocast_shared_prefix_on_cuda(attn, shared_layouts):
    """Under bf16 autocast the mask must suit the kernels (bool for sdpa, float32 bias for eager)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = tiny("llama", attn=attn).cuda()
    batch = tuple(t.cuda() for t in make_grouped())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = run(model, batch)
        got = run(model, batch, ForwardOptions())
    assert shared_layouts and shared_layouts[0] is not None
    mask = batch[3].bool()
    for g, w in zip(got[:2], want[:2]):
        torch.testing.assert_close(g[mask], w[mask], rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got[3], want[3], rtol=3e-2, atol=3e-1)


def _layout_used(monkeypatch, model, batch, options=ForwardOptions()):
    """The layout whose hidden states the forward computed."""
    used = []
    original = forward_module._hidden_states

    def spy(model, parts, layout):
        used.append(layout)
        return original(model, parts, layout)

    monkeypatch.setattr(forward_module, "_hidden_states", spy)
    with torch.no_grad():
        completion_logprobs(model, *batch[:4], TEMPERATURE, options=options)
    (layout,) = used
    return layout


@pytest.mark.parametrize(
    "groups, shared_wins",
    [(((30, (5, 4, 6, 5)),), True), (((2, (60, 58, 59, 60)),), False)],
    ids=["long-prompt-short-completions", "short-prompt-long-completions"],
)
def test_sharing_is_used_only_where_it_is_cheaper(monkeypatch, shared_layouts, groups, shared_wins):
    """A shared row is as wide as a prompt plus all its completions, and mask-based attention
    pays ``W²`` per row: with long completions the unshared rows cost less, and are used (the
    shared layout is then not even built)."""
    model = tiny("llama", attn="sdpa")
    batch = make_grouped(groups)
    parts = model_parts(model)
    shared = forward_module.shared_prefix_layout(*batch[:4], row_tokens=1)
    unshared = forward_module.packed_layout(*batch[:4], row_tokens=1)
    cost = lambda layout: decoder_cost(*layout.input_ids.shape, parts)  # noqa: E731
    assert (cost(shared) < cost(unshared)) == shared_wins

    layout = _layout_used(monkeypatch, model, batch)
    assert (layout.attention_mask is not None) == shared_wins  # the shared layout carries a 4-D mask
    assert (shared_layouts[-1] is not None) == shared_wins
    assert_same(run(model, batch, ForwardOptions()), reference(model, batch), batch[3])
