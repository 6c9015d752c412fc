"""One optimizer step, one gradient, whatever the layout (issue 10), for every loss type.

The same generation batch of 16 completions (4 prompts × 4 generations; the samples are checked
equal) is trained in one SGD step (lr 1, constant schedule: the update is the gradient) as

* the reference: 1 process, one micro-batch of 16 (``steps_per_generation=1``, no accumulation);
* 1 process, 4 accumulated micro-batches of 4 (``steps_per_generation=4``,
  ``accumulate_grad_batches=4``): the per-micro-step normalisers, the ``/GA`` of the grpo-like
  losses and Lightning's own ``/accumulate_grad_batches`` (undone by the module) are all on the
  path. ``generation_batch_size=16`` with ``per_device_train_batch_size=4`` resolves to the same
  plan (``steps_per_generation = 16/4``), so it is not a separate layout;
* 1 process, one micro-batch of 16 scored in token-budget parts (``train_token_budget=12``: 9
  forward+backward passes), the ``MicroBatchTotals`` path;
* 2 gloo DDP processes × 2 accumulated micro-batches of 4, and 2 processes × one micro-batch of 8
  (slow; one launch trains every loss type in turn, ``tests/e2e/layout_child.py``): DDP's gradient
  average over ranks and the ``N/P`` normaliser.

Every loss has ``beta = 0.04`` with a reference model moved away from the policy, so the KL term
has a gradient. The entropy bonus is not covered: it is TRL 1.16's per-micro-batch token mean,
which depends on the split (docs/losses.md). The samples are those of
:class:`~tests.e2e.layouts.PerPromptSeededSampler` (the same on any rank, cut to varied lengths so
micro-batches have different token counts). The tolerance is the float32 rounding of two runs of
the step (``tests/e2e/same_step.py``); ``test_bnpo_micro_batch_normalizer_depends_on_the_layout``
shows that a per-micro-batch token mean fails it by far.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo_lightning.losses import LOSSES
from tests.e2e.layouts import Layout, make_loss, train_one_step
from tests.e2e.same_step import assert_same_sgd_step
from tests.helpers import make_model_dir, write_prompts

REPO = Path(__file__).resolve().parents[2]
LOSS_TYPES = sorted(LOSSES)
REFERENCE = Layout(processes=1, rows=16, steps=1)
SINGLE_PROCESS = {
    "1x4_accumulated": Layout(processes=1, rows=4, steps=4),
    "1x16_token_budget_parts": Layout(processes=1, rows=16, steps=1, train_token_budget=12),
}
DDP = {"2x2_accumulated": "2:4:2", "2x1": "2:8:1"}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    model_dir, prompts = make_model_dir(root / "model"), write_prompts(root / "prompts.jsonl")
    initial = {n: p.detach().clone() for n, p in AutoModelForCausalLM.from_pretrained(model_dir).named_parameters()}
    return {"model": model_dir, "prompts": prompts, "root": root, "initial": initial, "references": {}}


def reference(assets, loss_type: str):
    """The 1-process, one-micro-batch step of ``loss_type`` (computed once per module)."""
    if loss_type not in assets["references"]:
        assets["references"][loss_type] = train_one_step(
            assets["model"], assets["prompts"], make_loss(loss_type), REFERENCE, str(assets["root"] / "runs")
        )
    return assets["references"][loss_type]


def assert_same_step(assets, loss_type: str, weights, completions, sizes, label: str) -> None:
    want, want_completions, want_sizes = reference(assets, loss_type)
    assert sorted(completions) == sorted(want_completions), f"{label}: the layouts must train on the same samples"
    assert sizes["tokens"] == want_sizes["tokens"]
    initial = assets["initial"]
    names = list(want)
    moved = sum(float((want[n] - initial[n]).abs().sum()) for n in names)
    assert moved > 1e-3, "the step did not move the weights: the comparison would be vacuous"
    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    assert_same_sgd_step([weights[n] for n in names], [want[n] for n in names], [initial[n] for n in names], model,
                         width=max(sizes["width"], want_sizes["width"]), tokens=sizes["tokens"],
                         temperature=want_sizes["temperature"], names=[f"{loss_type} {label} {n}" for n in names])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_single_process_layouts_take_the_same_step(assets, loss_type):
    for label, layout in SINGLE_PROCESS.items():
        weights, completions, sizes = train_one_step(
            assets["model"], assets["prompts"], make_loss(loss_type), layout, str(assets["root"] / "runs")
        )
        if layout.train_token_budget is not None:
            assert sizes["passes"] > 4, "the budget must split the micro-batch, or the comparison is vacuous"
        else:
            assert len(set(sizes["micro_batch_tokens"])) > 1, "micro-batches of equal token counts prove little"
        assert_same_step(assets, loss_type, weights, completions, sizes, label)


def test_bnpo_micro_batch_normalizer_depends_on_the_layout(assets):
    """TRL 1.16's bnpo (``normalizer="micro_batch"``): one micro-batch on one process is the same
    step as the default, 4 accumulated micro-batches (11-15 tokens each) are not."""
    trl_like = make_loss("bnpo", normalizer="micro_batch")
    want, _, _ = reference(assets, "bnpo")
    whole, _, _ = train_one_step(assets["model"], assets["prompts"], trl_like, REFERENCE, str(assets["root"] / "runs"))
    split, _, _ = train_one_step(assets["model"], assets["prompts"], trl_like, SINGLE_PROCESS["1x4_accumulated"],
                                 str(assets["root"] / "runs"))
    initial = assets["initial"]
    step = max(float((want[n] - initial[n]).abs().max()) for n in want)
    assert max(float((whole[n] - want[n]).abs().max()) for n in want) < 1e-3 * step
    assert max(float((split[n] - want[n]).abs().max()) for n in want) > 1e-2 * step


@pytest.mark.slow
def test_ddp_layouts_take_the_same_step(assets, tmp_path):
    out = tmp_path / "ddp"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(REPO / "tests" / "e2e" / "layout_child.py"), assets["model"], assets["prompts"], str(out),
               ",".join(LOSS_TYPES), ",".join(DDP.values())]
    result = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    for loss_type in LOSS_TYPES:
        for label, spec in DDP.items():
            name = f"{loss_type}_{spec.replace(':', 'x')}"
            weights = torch.load(out / f"{name}.pt")
            ranks = [json.loads((out / f"{name}_rank{r}.json").read_text()) for r in (0, 1)]
            completions = [tuple(c) for rank in ranks for c in rank["completions"]]
            sizes = {"width": max(r["sizes"]["width"] for r in ranks),
                     "tokens": sum(r["sizes"]["tokens"] for r in ranks)}
            assert_same_step(assets, loss_type, weights, completions, sizes, label)
