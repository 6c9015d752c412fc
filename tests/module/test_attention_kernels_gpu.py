"""The attention kernels on CUDA: flex (compiled, with gradients: CPU has no flex backward) and
torch's flash varlen under bf16 autocast, values and every parameter gradient against the plain
path; the LM-head chunk calibration. Skipped without a CUDA device (``scripts/gpu_check.sh smoke``
runs them)."""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.module import attention_kernels, lm_head_calibration
from grpo_lightning.module.forward import ForwardOptions
from tests.module.test_forward_paths import make_batch, run, tiny
from tests.module.test_shared_prefix_forward import make_grouped

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def cuda_only():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = {"flex": 0, "varlen": 0, "varlen_flash": 0}
    for name in ("flex", "varlen"):
        original = getattr(attention_kernels, f"_{name}")

        def spy(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            if _name == "varlen":
                query = args[1]
                calls["varlen_flash"] += int(query.dtype in (torch.bfloat16, torch.float16))
            return _original(*args, **kwargs)

        monkeypatch.setattr(attention_kernels, f"_{name}", spy)
    return calls


def ran(kernel: str, share: bool) -> str:
    """The kernel the layers are called with: ``auto`` is varlen for packing and flex for shared
    prompts; varlen runs as flex for a shared prefix and on a torch whose ``varlen_attn`` lacks the
    arguments it passes (torch 2.11, the first GPU image's: the run there called flex)."""
    if kernel == "flex" or share or not attention_kernels.varlen_supported():
        return "flex"
    return "varlen"


def close(got, want, mask, rtol, atol):
    """Log-probs and entropies on real completion tokens, the loss, and the flat gradient."""
    mask = mask.bool()
    for g, w in ((got[0][mask], want[0][mask]), (got[1][mask], want[1][mask]), (got[2], want[2])):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol)
    torch.testing.assert_close(got[3], want[3], rtol=rtol, atol=atol * 10)


def _cuda(batch):
    return tuple(t.cuda() for t in batch)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("kernel", ["flex", "varlen", "auto"])
def test_kernels_match_plain_fp32(kernel, share, kernel_calls):
    model = tiny("qwen2", tie=True, hidden_size=64).cuda()  # head_dim 16: flex's minimum
    batch = _cuda(make_grouped() if share else make_batch())
    want = run(model, batch)
    got = run(model, batch, ForwardOptions(attention_kernel=kernel, share_prompt_prefix=share, lm_head_chunk_tokens=4))
    close(got, want, batch[3], rtol=1e-4, atol=1e-4)
    assert kernel_calls[ran(kernel, share)] == model.config.num_hidden_layers  # (float32 varlen then runs flex inside)


@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("kernel", ["flex", "varlen"])
def test_kernels_match_plain_bf16_autocast(kernel, share, kernel_calls):
    model = tiny("llama", hidden_size=64).cuda()
    batch = _cuda(make_grouped() if share else make_batch())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = run(model, batch)
        got = run(model, batch, ForwardOptions(attention_kernel=kernel, share_prompt_prefix=share))
    close(got, want, batch[3], rtol=3e-2, atol=3e-2)
    assert kernel_calls[ran(kernel, share)] == model.config.num_hidden_layers
    if ran(kernel, share) == "varlen":
        assert kernel_calls["varlen_flash"] == model.config.num_hidden_layers  # the flash kernel ran


def test_chunk_calibration_picks_a_fitting_candidate_once():
    head = torch.nn.Linear(64, 32_000, bias=False, device="cuda")
    hidden = torch.randn(8, 64, device="cuda")
    lm_head_calibration._cache.clear()
    random_stream = torch.cuda.get_rng_state()
    chunk = lm_head_calibration.resolve_chunk_tokens("auto", head, hidden)
    assert torch.equal(torch.cuda.get_rng_state(), random_stream)  # sampling after a resume draws the same numbers
    assert chunk in lm_head_calibration.CANDIDATES and head.weight.grad is None
    assert lm_head_calibration.resolve_chunk_tokens("auto", head, hidden) == chunk and len(lm_head_calibration._cache) == 1


@pytest.mark.parametrize("share", [False, True], ids=["packed", "shared-prefix"])
def test_layouts_synchronize_once(share):
    """A packed layout is planned from one host copy of the batch and placed with non_blocking
    copies: one device synchronization (``torch.cuda.set_sync_debug_mode`` warns at each)."""
    import warnings

    from grpo_lightning.algo.packing import packed_layout
    from grpo_lightning.algo.shared_prefix import shared_prefix_layout

    batch = tuple(t.cuda() for t in (make_grouped() if share else make_batch())[:4])
    build = shared_prefix_layout if share else packed_layout
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            layout = build(*batch, row_tokens=64)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    print(f"{build.__name__}: {len(syncs)} synchronization(s)")
    assert layout is not None and layout.input_ids.is_cuda
    assert len(syncs) == 1, syncs
