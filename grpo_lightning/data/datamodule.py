"""``RolloutDataModule``: prompts in, training micro-batches of scored rollouts out."""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Literal

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from grpo_lightning.data.micro_steps import MicroStepRef, MicroStepSchedule, MicroStepStream
from grpo_lightning.data.prompt_order import PromptOrder, plan_generation_batches
from grpo_lightning.data.rollout_builder import Collective, RolloutBuilder, RolloutSettings
from grpo_lightning.data.sources import load_prompt_dataset
from grpo_lightning.rewards.loading import resolve_reward_funcs
from grpo_lightning.rewards.runner import RewardRunner
from grpo_lightning.samplers import Sampler, get_sampler
from grpo_lightning.types import GenerationParams, RolloutBatch, missing_handle_members

log = logging.getLogger(__name__)
# Our stream has an exact length and always runs in the main process (num_workers=0).
warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
warnings.filterwarnings("ignore", message=r"The 'train_dataloader' does not have many workers")

_SCALE_CHOICES = ("group", "batch", "none")
_AGGREGATIONS = ("sum_then_normalize", "normalize_then_sum")


class RolloutDataModule(pl.LightningDataModule):
    """Draws prompts, samples completions, scores them and serves GRPO micro-batches.

    Each generation batch holds ``generation_batch_size`` completions (``num_generations`` per
    prompt, over all ranks). It is generated right before the micro-step that needs it (never
    ahead, so rollouts are on-policy), shuffled, cut into ``steps_per_generation`` micro-batches of
    ``per_device_train_batch_size`` rows and replayed ``num_iterations`` times.

    Args:
        dataset: A hub-style dataset name, a local ``save_to_disk`` folder, a folder of data
            files, or a ``.jsonl``/``.json``/``.parquet``/``.csv`` file or glob.
        reward_funcs: Reward functions: dotted paths (``my_pkg.rewards.fn``), built-in names or
            callables (sync or ``async def``) taking ``prompts, completions, completion_ids``,
            every dataset column, ``trainer_state``, ``log_extra``, ``log_metric``, ``**kwargs``
            and returning one float (or ``None`` = not applicable) per completion.
        reward_weights: One weight per reward function (default: all 1.0).
        dataset_config: Configuration name of a hub dataset.
        split: Dataset split to train on.
        data_files: Data files for a hub-style or builder dataset.
        prompt_column: Column holding the prompt (text, or a list of chat messages).
        num_generations: Completions per prompt, ``G`` (>= 2).
        per_device_train_batch_size: Completions per micro-batch on each rank.
        generation_batch_size: Completions per generation batch over all ranks; exclusive with
            ``steps_per_generation``. Default: ``per_device_train_batch_size x world size x
            steps_per_generation``.
        steps_per_generation: Micro-batches per generation batch (default: the trainer's
            ``accumulate_grad_batches``, so one optimizer step uses one generation batch).
        num_iterations: Times each generation batch is replayed (PPO-style epochs, ``mu``).
        shuffle_dataset: Shuffle prompts each epoch (seeded).
        seed: Seed of the prompt order and of the micro-batch shuffling.
        generation: Sampling settings shared by all samplers (``max_completion_length``,
            ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
            ``generation_kwargs``).
        sampler: Generation back-end: a short name (``hf_generate``) or a ``class_path``.
        chat_template_kwargs: Extra arguments for ``apply_chat_template`` (e.g.
            ``enable_thinking: false``).
        prompt_as_chat: Wrap plain-text prompts as a user message, so an instruct model's chat
            template is applied (datasets such as GSM8K store the question as text).
        system_prompt: A system message put before each conversational prompt that has none.
        scale_rewards: Advantage scaling: ``group`` (per-group std), ``batch`` (whole-batch std) or
            ``none``; ``true``/``false`` mean ``group``/``none``.
        multi_objective_aggregation: ``sum_then_normalize`` (weighted sum, then group
            normalisation) or ``normalize_then_sum`` (GDPO: normalise each reward per group first).
        mask_truncated_completions: Exclude completions cut by ``max_completion_length`` from the
            loss (they still count in the group statistics, as in TRL).
    """

    def __init__(
        self,
        dataset: str,
        reward_funcs: list[Callable | str],
        reward_weights: list[float] | None = None,
        dataset_config: str | None = None,
        split: str = "train",
        data_files: str | list[str] | None = None,
        prompt_column: str = "prompt",
        num_generations: int = 8,
        per_device_train_batch_size: int = 8,
        generation_batch_size: int | None = None,
        steps_per_generation: int | None = None,
        num_iterations: int = 1,
        shuffle_dataset: bool = True,
        seed: int = 42,
        generation: GenerationParams = GenerationParams(),
        sampler: str | Sampler = "hf_generate",
        chat_template_kwargs: dict[str, Any] | None = None,
        prompt_as_chat: bool = False,
        system_prompt: str | None = None,
        scale_rewards: Literal["group", "batch", "none"] | bool = "group",
        multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize",
        mask_truncated_completions: bool = False,
    ) -> None:
        super().__init__()
        if not reward_funcs:
            raise ValueError("data.reward_funcs is empty: give at least one reward function.")
        if num_iterations < 1:
            raise ValueError(f"data.num_iterations={num_iterations}: it must be >= 1.")
        if isinstance(scale_rewards, str) and scale_rewards not in _SCALE_CHOICES:
            raise ValueError(f"data.scale_rewards={scale_rewards!r}: use one of {_SCALE_CHOICES} (or true/false).")
        if multi_objective_aggregation not in _AGGREGATIONS:
            raise ValueError(
                f"data.multi_objective_aggregation={multi_objective_aggregation!r}: use one of {_AGGREGATIONS}."
            )
        # World-size-independent checks now, before any model work (the full plan in setup()).
        _check_sizes(num_generations, per_device_train_batch_size, generation_batch_size, steps_per_generation)
        self.rewards = RewardRunner(resolve_reward_funcs(reward_funcs), reward_weights)
        self.sampler = get_sampler(sampler)
        self.dataset_source = dict(path_or_name=dataset, name=dataset_config, split=split, data_files=data_files, prompt_column=prompt_column)
        self.num_generations = num_generations
        self.per_device_train_batch_size = per_device_train_batch_size
        self.generation_batch_size = generation_batch_size
        self.steps_per_generation = steps_per_generation
        self.num_iterations = num_iterations
        self.shuffle_dataset = shuffle_dataset
        self.seed = seed
        self.generation = generation
        self.chat_template_kwargs = chat_template_kwargs
        self.prompt_as_chat = prompt_as_chat
        self.system_prompt = system_prompt
        self.scale_rewards = scale_rewards
        self.multi_objective_aggregation = multi_objective_aggregation
        self.mask_truncated_completions = mask_truncated_completions

        self.train_dataset = None
        self.builder: RolloutBuilder | None = None
        self.schedule: MicroStepSchedule | None = None
        self.prompt_order: PromptOrder | None = None
        self.micro_steps_done = 0  # micro-steps actually trained (not prefetched): the resume point
        self.num_tokens = 0
        self._buffer_key: tuple[int, int] | None = None
        self._buffer: list[RolloutBatch] = []

    # ------------------------------------------------------------------------------ setup
    def setup(self, stage: str) -> None:
        if stage != "fit" or self.builder is not None:
            return
        handle = self.trainer.lightning_module
        missing = missing_handle_members(handle)
        if missing:
            raise TypeError(
                "RolloutDataModule needs a LightningModule that implements grpo_lightning.types."
                f"PolicyHandle (such as GRPOModule); {type(handle).__name__} lacks {missing}."
            )
        trainer = self.trainer
        plan = plan_generation_batches(
            self.per_device_train_batch_size, self.num_generations, trainer.world_size,
            self.generation_batch_size, self.steps_per_generation, trainer.accumulate_grad_batches,
        )
        self.train_dataset = load_prompt_dataset(**self.dataset_source)
        self.prompt_order = PromptOrder(len(self.train_dataset), plan.prompts_per_generation, self.shuffle_dataset, self.seed)
        self.schedule = MicroStepSchedule(self.prompt_order.generations_per_epoch, plan.steps_per_generation, self.num_iterations)
        if self.schedule.steps_per_epoch % trainer.accumulate_grad_batches:
            log.warning(
                "An epoch has %d micro-steps, not a multiple of trainer.accumulate_grad_batches=%d: "
                "the last optimizer step of each epoch accumulates fewer micro-batches.",
                self.schedule.steps_per_epoch, trainer.accumulate_grad_batches,
            )
        settings = RolloutSettings(
            num_generations=self.num_generations, plan=plan, params=self.generation,
            gradient_accumulation_steps=trainer.accumulate_grad_batches, num_iterations=self.num_iterations,
            chat_template_kwargs=self.chat_template_kwargs, scale_rewards=self.scale_rewards,
            multi_objective_aggregation=self.multi_objective_aggregation,
            mask_truncated_completions=self.mask_truncated_completions,
        )
        if trainer.is_global_zero:
            log.info(run_summary(settings, self.schedule, trainer, handle.needs_reference_logprobs))
        collective = Collective(trainer.global_rank, trainer.world_size, self._all_gather)
        self.sampler.bind(handle)
        self.builder = RolloutBuilder(settings, self.sampler, self.rewards, handle, collective)

    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.trainer.strategy.all_gather(tensor)

    def train_dataloader(self) -> DataLoader:
        if self.schedule is None:
            raise RuntimeError("RolloutDataModule.setup('fit') must run before train_dataloader().")
        stream = MicroStepStream(self.schedule, start_step=lambda: self.micro_steps_done)
        return DataLoader(stream, batch_size=None, num_workers=0)

    # ------------------------------------------------------------------ rollouts, just in time
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        if isinstance(batch, MicroStepRef):
            return batch  # a descriptor: nothing to move
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if not isinstance(batch, MicroStepRef):
            return batch
        micro_batch = self.micro_batch(batch)
        self.micro_steps_done = batch.step + 1
        return micro_batch

    def micro_batch(self, ref: MicroStepRef) -> RolloutBatch:
        """The micro-batch for ``ref``, generating its generation batch first if needed."""
        key = (ref.epoch, ref.generation)
        fresh = key != self._buffer_key
        if fresh:
            self._buffer = self._generate(ref)
            self._buffer_key = key
        batch = self._buffer[ref.micro_index]
        if not (fresh and ref.micro_index == 0 and ref.iteration == 0):
            batch = _without_generation_metrics(batch)
        batch.iteration = ref.iteration
        return batch

    def _generate(self, ref: MicroStepRef) -> list[RolloutBatch]:
        assert self.builder is not None and self.prompt_order is not None
        plan = self.builder.settings.plan
        prompts = self.prompt_order.prompt_indices(ref.epoch, ref.generation)
        global_ids = [i for i in prompts for _ in range(self.num_generations)]
        rank = self.trainer.global_rank
        row_ids = global_ids[rank * plan.local_rows : (rank + 1) * plan.local_rows]
        rows = [self._format_row(self.train_dataset[i]) for i in row_ids]
        # A private generator per generation batch: the micro-batch shuffle is reproducible on
        # resume and independent of any other use of the global RNG.
        generator = torch.Generator().manual_seed(
            (self.seed * 1_000_003 + rank) * 1_000_003 + ref.epoch * 1_000_003 + ref.generation
        )
        built = self.builder.build(rows, row_ids, generator, trainer_state=self.trainer)
        self.num_tokens += built.num_tokens
        for index, micro in enumerate(built.micro_batches):
            micro.generation_index, micro.micro_index = ref.generation, index
        built.micro_batches[0].generation_metrics["num_tokens"] = float(self.num_tokens)
        return built.micro_batches

    def _format_row(self, row: dict[str, Any]) -> dict[str, Any]:
        prompt = row["prompt"]
        if self.prompt_as_chat and isinstance(prompt, str):
            prompt = [{"role": "user", "content": prompt}]
        if self.system_prompt is not None and isinstance(prompt, list) and prompt[0].get("role") != "system":
            prompt = [{"role": "system", "content": self.system_prompt}, *prompt]
        return {**row, "prompt": prompt}

    # ---------------------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        return {"micro_steps_done": self.micro_steps_done, "num_tokens": self.num_tokens}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.micro_steps_done = int(state_dict["micro_steps_done"])
        self.num_tokens = int(state_dict["num_tokens"])
        self._buffer_key, self._buffer = None, []


def run_summary(settings: RolloutSettings, schedule: MicroStepSchedule, trainer: Any, reference: bool) -> str:
    """GRPO's batch arithmetic in a few lines: the most common source of confusion."""
    plan, accumulate = settings.plan, trainer.accumulate_grad_batches
    if trainer.max_steps and trainer.max_steps > 0:
        planned = f"{trainer.max_steps} (trainer.max_steps)"
    else:
        epochs = trainer.max_epochs if trainer.max_epochs not in (None, -1) else 1
        planned = f"{epochs * schedule.steps_per_epoch // accumulate} ({epochs} epoch(s))"
    per_step = trainer.world_size * accumulate * (plan.local_rows // plan.steps_per_generation)
    return "\n".join([
        "GRPO run summary",
        f"  world size {trainer.world_size}; micro-batch {plan.local_rows // plan.steps_per_generation} completions "
        f"per rank; accumulation {accumulate}",
        f"  generation batch: {plan.generation_batch_size} completions = {plan.prompts_per_generation} prompts x "
        f"{settings.num_generations}; cut into {plan.steps_per_generation} micro-batches per rank, replayed "
        f"{settings.num_iterations} time(s)",
        f"  optimizer step: {per_step} completions; {schedule.steps_per_epoch // accumulate} steps per epoch; "
        f"planned optimizer steps: {planned}",
        f"  forward passes per micro-batch: policy (with grad)"
        f"{'; old log-probs (no grad)' if settings.needs_old_logprobs else ''}"
        f"{'; reference log-probs (no grad)' if reference else ''}",
    ])


def _without_generation_metrics(batch: RolloutBatch) -> RolloutBatch:
    from dataclasses import replace

    return replace(batch, generation_metrics={}, prepare_seconds=0.0)


def _check_sizes(
    num_generations: int, per_device_train_batch_size: int, generation_batch_size: int | None, steps_per_generation: int | None
) -> None:
    if num_generations < 2:
        raise ValueError(
            f"data.num_generations={num_generations}: GRPO compares completions within a group, so it "
            "needs at least 2 completions per prompt."
        )
    if per_device_train_batch_size < 1:
        raise ValueError(f"data.per_device_train_batch_size={per_device_train_batch_size}: it must be >= 1.")
    if generation_batch_size is not None and steps_per_generation is not None:
        raise ValueError(
            f"data.generation_batch_size={generation_batch_size} and data.steps_per_generation="
            f"{steps_per_generation} are both set, but each determines the other: set only one."
        )
    if generation_batch_size is not None and generation_batch_size % num_generations:
        raise ValueError(
            f"data.generation_batch_size={generation_batch_size} is not a multiple of data.num_generations="
            f"{num_generations}: every prompt's group must fit in one generation batch."
        )
