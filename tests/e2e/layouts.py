"""One generation batch trained in one SGD step under a given layout (tests/e2e/test_layout_invariance.py).

Shared by the single-process tests and the DDP child (``tests/e2e/layout_child.py``), so that every
layout trains on the same samples with the same settings:

* :class:`PerPromptSeededSampler` samples each prompt's completions from a generator seeded by the
  prompt's ids, so a prompt gets the same completions on any rank and in any world size; each
  completion is then cut to a length drawn from the same generator, so micro-batches have
  different token counts (what separates a per-micro-batch token mean from a per-step one);
* :class:`PerturbReference` moves the reference model away from the policy (seeded), so that the
  KL term has a gradient at the first step (a copy of the policy has zero KL and zero gradient).
"""

from __future__ import annotations

import functools
import warnings
import zlib
from dataclasses import dataclass

import lightning.pytorch as pl
import torch

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.losses import get_loss
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.forward_options import ForwardOptions
from grpo_lightning.samplers import HFGenerateSampler
from grpo_lightning.types import GenerationParams
from tests.helpers import length_reward

MAX_COMPLETION_LENGTH = 6
NUM_GENERATIONS = 4
STEP_ROWS = 16  # 4 prompts x 4 generations: the one generation batch of the step
BETA = 0.04


class PerPromptSeededSampler(HFGenerateSampler):
    """HF generate, one prompt at a time from a generator seeded by the prompt's ids; each
    completion is cut to a seeded length in ``[1, its length]``."""

    def generate(self, prompts, num_generations, params):
        rollouts = []
        for prompt in prompts:
            seed = zlib.crc32(bytes(str(list(prompt)), "ascii"))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                sampled = super().generate([prompt], num_generations, params)
                for rollout in sampled:
                    keep = int(torch.randint(1, len(rollout.completion_ids) + 1, ()))
                    if keep < len(rollout.completion_ids):
                        rollout.completion_ids = rollout.completion_ids[:keep]
                        rollout.ended_on_eos = False
            rollouts += sampled
        return rollouts


class PerturbReference(pl.Callback):
    """Add seeded noise to the reference model's weights when fitting starts."""

    def on_fit_start(self, trainer, pl_module):
        if pl_module.ref_policy is None:
            return
        generator = torch.Generator().manual_seed(1234)
        with torch.no_grad():
            for p in pl_module.ref_policy.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device))


@dataclass(frozen=True)
class Layout:
    """How the step's 16 rows are split: per rank ``steps`` accumulated micro-batches of ``rows``,
    each scored in token-budget parts when ``train_token_budget`` is set."""

    processes: int
    rows: int
    steps: int
    train_token_budget: int | None = None

    def __post_init__(self) -> None:
        assert self.processes * self.rows * self.steps == STEP_ROWS


LOSS_KNOBS = {"luspo": {"importance_sampling_level": "sequence"}}


def make_loss(loss_type: str, beta: float = BETA, **knobs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # advice about ratio levels, not what these tests check
        return get_loss(loss_type, beta=beta, **LOSS_KNOBS.get(loss_type, {}), **knobs)


def train_one_step(model_dir: str, prompts: str, loss, layout: Layout, root: str, **trainer_kwargs):
    """Fit one optimizer step (SGD, lr 1, constant schedule: the update is the gradient).

    Returns the policy's parameters after the step (by name), and this rank's completions and
    ``(prompt+completion width, loss tokens)`` of its micro-batches.
    """
    pl.seed_everything(7, verbose=False)
    module = GRPOModule(model_dir, loss=loss, optimizer=functools.partial(torch.optim.SGD, lr=1.0),
                        lr_scheduler_type="constant", save_final_model=False,
                        forward=ForwardOptions(train_token_budget=layout.train_token_budget))
    parts = {"calls": 0}
    score = module._policy_loss

    def counting(batch, totals):
        parts["calls"] += 1
        return score(batch, totals)

    module._policy_loss = counting
    data = RolloutDataModule(prompts, reward_funcs=[length_reward], num_generations=NUM_GENERATIONS,
                             per_device_train_batch_size=layout.rows, steps_per_generation=layout.steps,
                             sampler=PerPromptSeededSampler(),
                             generation=GenerationParams(max_completion_length=MAX_COMPLETION_LENGTH))
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         accumulate_grad_batches=layout.steps, default_root_dir=root,
                         callbacks=[PerturbReference()], **trainer_kwargs)
    trainer.fit(module, data)
    assert len(data.buffer.batches) == layout.steps, "one generation batch must be exactly one optimizer step"
    weights = {name: p.detach().clone() for name, p in module.policy.named_parameters()}
    batches = data.buffer.batches
    completions = [tuple(ids[mask.bool()].tolist()) for b in batches
                   for ids, mask in zip(b.completion_ids, b.completion_mask)]
    sizes = {"width": max(b.prompt_ids.shape[1] + b.completion_ids.shape[1] for b in batches),
             "tokens": sum(int(b.completion_mask.sum()) for b in batches),
             "micro_batch_tokens": [int(b.completion_mask.sum()) for b in batches],
             "passes": parts["calls"], "temperature": batches[0].temperature}
    return weights, completions, sizes
