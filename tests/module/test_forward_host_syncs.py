"""The optimized forwards read tensor values on the host only while building their layout, never per
decoder layer: on CUDA every such read (``.item()``, ``nonzero``, boolean-mask indexing) waits for
the device, so one per layer would serialise kernel launch and execution through the whole model.

Counted on CPU with a dispatch mode that sees every aten call, for every kernel that runs here
(``sdpa_mask``; ``varlen``'s CPU fallback; ``flex`` forward-only): the count is the same for a
2-layer and a 4-layer model, in the forward and in the backward.
"""

from __future__ import annotations

import traceback
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


# ------------------------------------------------------------------ reads of the device batch
def _caller() -> str:
    """``"model"`` when the innermost frame outside torch is transformers' (the model's own mask
    preparation), else ``"ours"``."""
    for frame in reversed(traceback.extract_stack()[:-3]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path:
            continue
        return "model" if "/transformers/" in path else "ours"
    return "ours"


class CountDeviceReads(TorchDispatchMode):
    """Host reads of *device* tensors, on CPU: the batch is marked as on the device, and so is
    every tensor computed from one, or placed by ``to_device``; a copy of a marked tensor to the
    CPU (``_to_copy`` to ``cpu`` keeping its dtype) is a transfer, counted apart, whose result is
    a host tensor. On CUDA each read and each transfer waits for the kernels already queued.
    Both are counted by who made them: ``ours`` or the ``model`` (transformers' own code)."""

    def __init__(self, *device_tensors: torch.Tensor) -> None:
        super().__init__()
        self.on_device: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive: ids stay unique)
        self.reads: Counter[tuple[str, str]] = Counter()
        self.transfers: Counter[str] = Counter()
        for tensor in device_tensors:
            self.mark(tensor)

    def mark(self, tensor: torch.Tensor) -> torch.Tensor:
        self.on_device[id(tensor)] = tensor
        return tensor

    def _marked(self, tree) -> bool:
        leaves, _ = torch.utils._pytree.tree_flatten(tree)
        return any(isinstance(x, torch.Tensor) and id(x) in self.on_device for x in leaves)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        out = func(*args, **kwargs)
        if not self._marked((args, kwargs)):
            return out
        if (name == "aten._to_copy.default" and kwargs.get("device") == torch.device("cpu")
                and kwargs.get("dtype", args[0].dtype) == args[0].dtype):
            self.transfers[_caller()] += 1
            return out  # a host copy
        if name in _HOST_READS or (name == "aten.index.Tensor" and any(
                i is not None and i.dtype == torch.bool for i in args[1])):
            self.reads[_caller(), name] += 1
        leaves, _ = torch.utils._pytree.tree_flatten(out)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self.mark(leaf)
        return out

    def ours(self) -> tuple[int, dict]:
        """(our transfers, our reads by op)."""
        return self.transfers["ours"], {op: n for (who, op), n in self.reads.items() if who == "ours"}


@pytest.fixture
def device_reads(monkeypatch):
    """Starts a ``CountDeviceReads`` over a batch; the layouts' ``to_device`` places a marked
    copy (on CPU ``.to`` would return the host tensor itself, which stays a host tensor)."""
    from grpo_lightning.algo import packing, shared_prefix
    from grpo_lightning.module import attention_kernels, forward

    modes: list[CountDeviceReads] = []

    def placed(tensor, device):
        return modes[-1].mark(tensor.clone()) if modes else tensor

    for module in (packing, shared_prefix, attention_kernels, forward):
        monkeypatch.setattr(module, "to_device", placed)

    def start(*batch):
        modes.append(CountDeviceReads(*batch))
        return modes[-1]

    return start


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_forward_reads_the_device_batch_once(case, device_reads):
    """Our side of the forward reads the device batch once, as one transfer of the tensors its
    layout is planned from, and no device value otherwise (forward or backward). The model's own
    reads (transformers detects packed sequences from the position ids) are not ours to remove."""
    options, backward = CASES[case]
    batch = (make_grouped() if "shared" in case else make_batch())[:4]
    model = _model(2)
    with torch.set_grad_enabled(backward), device_reads(*batch) as mode:
        logps, _ = completion_logprobs(model, *batch, TEMPERATURE, options=options)
        if backward:
            (logps * batch[3]).sum().backward()
    assert mode.ours() == (1, {}), f"{case}: (transfers, reads) {mode.ours()}"


@pytest.mark.parametrize("padding_free", [True, False], ids=["packed", "padded"])
def test_token_budget_groups_are_planned_from_one_copy(device_reads, padding_free):
    """Several groups, one transfer: each group's layout is planned on its slice of the host copy."""
    options = ForwardOptions(padding_free=padding_free, share_prompt_prefix=padding_free, logprob_token_budget=40)
    batch = make_grouped()[:4]
    with torch.no_grad(), device_reads(*batch) as mode:
        completion_logprobs(_model(2), *batch, TEMPERATURE, options=options)
    assert mode.ours() == (1, {})


def test_the_device_counter_sees_a_read_and_a_transfer():
    device = torch.arange(6)
    with CountDeviceReads(device) as mode:
        host = device.to("cpu", copy=True)
        host[host > 2].sum().item()  # host values: not counted
        (device * 2)[device > 2]  # a boolean index of a device tensor
        device.to(torch.float64)  # a cast on the device: no transfer
    assert mode.ours() == (1, {"aten.index.Tensor": 1})
