"""The optimized forwards read tensor values on the host only while building their layout, never per
decoder layer: on CUDA every such read (``.item()``, ``nonzero``, boolean-mask indexing) waits for
the device, so one per layer would serialise kernel launch and execution through the whole model.

Counted on CPU with a dispatch mode that sees every aten call, for every kernel that runs here
(``sdpa_mask``; ``varlen``'s CPU fallback; ``flex`` forward-only): the count is the same for a
2-layer and a 4-layer model, in the forward and in the backward.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from grpo_lightning.module.forward import ForwardOptions, completion_logprobs
from grpo_lightning.utils.tiny_models import build_tiny_causal_lm
from tests.module.test_forward_paths import TEMPERATURE, VOCAB, make_batch, perturbed
from tests.module.test_shared_prefix_forward import make_grouped

# Ops whose output the host must read (value or data-dependent shape).
_HOST_READS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
               "aten.is_nonzero.default", "aten.unique_consecutive.default", "aten._unique2.default",
               "aten.repeat_interleave.Tensor", "aten.bincount.default"}


class CountHostReads(TorchDispatchMode):
    """Counts the host reads of the aten calls made under it (boolean-mask ``index`` included)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in _HOST_READS or (name == "aten.index.Tensor" and any(
                i is not None and i.dtype == torch.bool for i in args[1])):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def _model(layers: int):
    model = build_tiny_causal_lm(VOCAB, num_layers=layers)
    model.config._attn_implementation = "sdpa"
    return perturbed(model)


@pytest.fixture(autouse=True)
def flex_outside_the_counter(monkeypatch):
    """The flex call itself runs with the counter off: it is one compiled kernel on CUDA (and
    torch.compile refuses a dispatch mode); everything around it (block masks, dispatch) counts."""
    from torch.utils._python_dispatch import _disable_current_modes

    from grpo_lightning.module import attention_kernels

    flex = attention_kernels._flex

    def uncounted(*args, **kwargs):
        with _disable_current_modes():
            return flex(*args, **kwargs)

    monkeypatch.setattr(attention_kernels, "_flex", uncounted)


def _host_reads(layers: int, batch, options: ForwardOptions, backward: bool) -> tuple[Counter, Counter]:
    """(reads in the forward, reads in the backward) of one training forward."""
    model = _model(layers)
    prompt_ids, prompt_mask, completion_ids, completion_mask = batch[:4]
    with torch.set_grad_enabled(backward), CountHostReads() as forward:
        logps, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, TEMPERATURE,
                                       options=options)
    with CountHostReads() as back:
        if backward:
            (logps * completion_mask).sum().backward()
    return forward.counts, back.counts


CASES = {
    "packed sdpa_mask": (ForwardOptions(padding_free=True, share_prompt_prefix=False), True),
    "shared prefix sdpa_mask": (ForwardOptions(padding_free=True, share_prompt_prefix=True), True),
    "packed varlen (CPU fallback)": (ForwardOptions(padding_free=True, share_prompt_prefix=False,
                                                    attention_kernel="varlen"), True),
    "packed flex (forward only)": (ForwardOptions(padding_free=True, share_prompt_prefix=False,
                                                  attention_kernel="flex"), False),
    "shared prefix flex (forward only)": (ForwardOptions(padding_free=True, share_prompt_prefix=True,
                                                         attention_kernel="flex"), False),
    "chunked head, padded": (ForwardOptions(padding_free=False, lm_head_chunk_tokens=4), True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_host_reads_do_not_grow_with_depth(case):
    options, backward = CASES[case]
    batch = make_grouped() if "shared" in case else make_batch()
    shallow, deep = _host_reads(2, batch, options, backward), _host_reads(4, batch, options, backward)
    assert deep == shallow, f"{case}: host reads 2 layers {shallow}, 4 layers {deep}"
    assert sum(shallow[1].values()) == 0, f"{case}: the backward reads the host: {shallow[1]}"


def test_the_counter_sees_a_host_read():
    with CountHostReads() as mode:
        torch.arange(4).sum().item()
        torch.arange(4)[torch.arange(4) > 1]
    assert mode.counts == {"aten._local_scalar_dense.default": 1, "aten.index.Tensor": 1}
