"""``RolloutDataModule``: prompts in, training micro-batches of scored rollouts out."""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace
from typing import Any, Callable, Literal, Sequence

import lightning.pytorch as pl
import torch
from jsonargparse import lazy_instance
from torch.utils.data import DataLoader

from grpo_lightning.algo.importance import ImportanceSamplingCorrection
from grpo_lightning.data.agent_wiring import AgentSettings, environment_prompt, wire_agent
from grpo_lightning.data.dynamic_sampling import DynamicSampler, DynamicSampling
from grpo_lightning.data.evaluation import EvalPlan, EvalRef, EvalStream, eval_sources, eval_step_seed, isolated_rng
from grpo_lightning.data.generation_buffer import GenerationBuffer
from grpo_lightning.data.micro_steps import (
    DescriptorLoader, MicroStepRef, MicroStepSchedule, MicroStepStream, resume_position, window_steps,
)
from grpo_lightning.data.prompt_order import GenerationPlan, PromptOrder, data_seed, plan_generation_batches, shuffle_seed
from grpo_lightning.data.prompt_sets import load_prompt_sets
from grpo_lightning.data.prompt_format import check_completion_fits, check_system_prompt, format_row
from grpo_lightning.data.resume_state import check_same_plan, resumed_prompt_order, run_plan, table_from_state, table_state
from grpo_lightning.data.collective import trainer_collective
from grpo_lightning.data.rollout_builder import RolloutBuilder, RolloutSettings
from grpo_lightning.data.run_summary import check_data_settings, check_sizes, check_trainer_settings, run_summary
from grpo_lightning.data.trainer_state import build_trainer_state
from grpo_lightning.data.weight_sync import WeightSync
from grpo_lightning.rewards.loading import resolve_reward_funcs
from grpo_lightning.rewards.runner import RewardRunner
from grpo_lightning.samplers import HFGenerateSampler, Sampler, get_sampler
from grpo_lightning.types import CompletionTable, GenerationParams, RolloutBatch, missing_handle_members
from grpo_lightning.utils.lazy_defaults import fresh_instance

log = logging.getLogger(__name__)
# Our stream has an exact length and always runs in the main process (num_workers=0).
warnings.filterwarnings("ignore", message=r"Your `IterableDataset` has `__len__` defined")
warnings.filterwarnings("ignore", message=r"The 'train_dataloader' does not have many workers")
# Without evaluation sets val_dataloader() returns [] on purpose (no validation loop).
warnings.filterwarnings("ignore", message=r"Total length of `list` across ranks is zero")


class RolloutDataModule(pl.LightningDataModule):
    """Draws prompts, samples completions, scores them and serves GRPO micro-batches.

    Each generation batch holds ``generation_batch_size`` completions (``num_generations`` per
    prompt, over all ranks). It is generated right before the micro-step that needs it (never
    ahead, so rollouts are on-policy), shuffled, cut into ``steps_per_generation`` micro-batches of
    ``per_device_train_batch_size`` rows and replayed ``num_iterations`` times.

    Args:
        dataset: A hub-style dataset name, a local ``save_to_disk`` folder, a folder of data
            files, or a ``.jsonl``/``.json``/``.parquet``/``.csv`` file or glob; unset when ``agent``'s environment makes the prompts.
        reward_funcs: Reward functions: dotted paths (``my_pkg.rewards.fn``), built-in names or
            callables (sync or ``async def``) taking ``prompts, completions, completion_ids``,
            every dataset column, ``trainer_state``, ``log_extra``, ``log_metric``, ``**kwargs``
            and returning one float (or ``None`` = not applicable) per completion.
            A path to a sequence-classification model (``num_labels=1``) or a
            ``class_path: grpo_lightning.rewards.RewardModel`` entry makes a reward model.
        reward_weights: One weight per reward function (default: all 1.0).
        reward_processing_classes: Tokenizers of the reward models: one per reward function
            (``null`` for functions and for a model's own tokenizer) or one for all.
        reward_model_init_kwargs: ``from_pretrained`` arguments of reward models given as a path
            or Hub id (e.g. ``{dtype: bfloat16, revision: main}``; TRL's ``model_init_kwargs``).
            A ``RewardModel`` entry has its own ``model_init_kwargs``.
        reward_trust_remote_code: Allow custom code for reward models given as a path or Hub id
            and their tokenizers (TRL's ``trust_remote_code``, which also covers reward models).
        reward_timeout_s: Seconds a reward call may take, or ``{name: seconds}``: a late call scores None.
        dataset_config: Configuration name of a hub dataset.
        split: Dataset split to train on.
        data_files: Data files for a hub-style or builder dataset.
        prompt_column: Column holding the prompt (text, or a list of chat messages).
        prompt_template: Build each prompt from the row's columns with a Python format string
            instead (e.g. ``"Use {nums} to make {target}."``); combine with ``prompt_as_chat``.
        num_generations: Completions per prompt, ``G`` (>= 2).
        per_device_train_batch_size: Completions per micro-batch on each rank.
        generation_batch_size: Completions per generation batch over all ranks; exclusive with
            ``steps_per_generation``. Default: ``per_device_train_batch_size x world size x
            steps_per_generation``.
        steps_per_generation: Micro-batches per generation batch (default: the trainer's
            ``accumulate_grad_batches``, so one optimizer step uses one generation batch).
        num_iterations: Times each generation batch is replayed (PPO-style epochs, ``mu``).
        shuffle_dataset: Shuffle prompts each epoch (seeded).
        seed: Seed of the prompt order and of the micro-batch shuffling. Default: the global
            seed that Lightning's ``seed_everything`` set (``PL_GLOBAL_SEED``; the CLI's
            ``seed_everything``), else 42.
        generation: Sampling settings shared by all samplers (``max_completion_length``,
            ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``,
            ``generation_kwargs``).
        sampler: Generation back-end: a short name (``hf_generate``) or a ``class_path`` with its
            knobs (default: ``HFGenerateSampler``); a saved config lists them all.
        importance_sampling: Correction for the gap between the sampler's and the trainer's
            log-probs (``enabled``, ``mode``, ``clip_min``, ``clip_max``; TRL's
            ``vllm_importance_sampling_*``), applied when the sampler returns log-probs.
        dynamic_sampling: DAPO's dynamic sampling (``max_extra_rounds``, ``on_exhausted``): drop the groups
            whose rewards tie, refill from the next prompts (``docs/dynamic_sampling.md``). Default: off.
        agent: Tools and environments (``tools``, ``environment_factory``, ``max_tool_calling_iterations``; docs/agents.md).
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
        eval_dataset: Evaluation prompts, in the same forms as ``dataset``; a mapping
            ``{name: source}`` evaluates several sets (metrics ``eval_<name>_*``). Evaluation runs
            in Lightning's validation loop (``trainer.val_check_interval``,
            ``check_val_every_n_epoch``, ``grpo validate``) with the same sampler and rewards.
        eval_split: Split of a hub-style ``eval_dataset`` (a file is loaded as this split).
        num_generations_eval: Completions per evaluation prompt (default: ``num_generations``).
        per_device_eval_batch_size: Completions per validation step on each rank (a multiple of
            ``num_generations_eval``).
    """

    def __init__(
        self,
        dataset: str | None = None,
        reward_funcs: list[str | Callable] | None = None,
        reward_weights: list[float] | None = None,
        reward_processing_classes: list[str | None] | str | None = None,
        reward_model_init_kwargs: dict[str, Any] | None = None,
        reward_trust_remote_code: bool = False,
        reward_timeout_s: float | dict[str, float | None] | None = None,
        dataset_config: str | None = None,
        split: str = "train",
        data_files: str | list[str] | None = None,
        prompt_column: str = "prompt",
        prompt_template: str | None = None,
        num_generations: int = 8,
        per_device_train_batch_size: int = 8,
        generation_batch_size: int | None = None,
        steps_per_generation: int | None = None,
        num_iterations: int = 1,
        shuffle_dataset: bool = True,
        seed: int | None = None,
        generation: GenerationParams = GenerationParams(),
        sampler: Sampler | str = lazy_instance(HFGenerateSampler),
        importance_sampling: ImportanceSamplingCorrection = ImportanceSamplingCorrection(),
        dynamic_sampling: DynamicSampling | None = None,
        agent: AgentSettings | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        prompt_as_chat: bool = False,
        system_prompt: str | None = None,
        scale_rewards: Literal["group", "batch", "none"] | bool = "group",
        multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize",
        mask_truncated_completions: bool = False,
        eval_dataset: str | dict[str, str] | None = None,
        eval_split: str = "test",
        num_generations_eval: int | None = None,
        per_device_eval_batch_size: int = 8,
    ) -> None:
        super().__init__()
        dataset, reward_funcs, reward_weights, sampler = wire_agent(agent, dataset, reward_funcs, reward_weights, sampler, chat_template_kwargs)
        # World-size-independent checks now, before any model work (the full plan in setup()).
        check_data_settings(reward_funcs, num_iterations, scale_rewards, multi_objective_aggregation)
        check_sizes(num_generations, per_device_train_batch_size, generation_batch_size, steps_per_generation)
        self.rewards = RewardRunner(
            resolve_reward_funcs(
                reward_funcs, reward_processing_classes, model_init_kwargs=reward_model_init_kwargs,
                trust_remote_code=reward_trust_remote_code,
            ),
            reward_weights,
            chat_template_kwargs=chat_template_kwargs, timeout_s=reward_timeout_s,
        )
        self.sampler = get_sampler(fresh_instance(sampler))
        self.sampler.check_generation(generation)
        self.dataset_source = dict(
            path_or_name=dataset, name=dataset_config, split=split, data_files=data_files,
            prompt_column=prompt_column, prompt_template=prompt_template, default_prompt=environment_prompt(agent),
        )
        self.num_generations = num_generations
        self.per_device_train_batch_size = per_device_train_batch_size
        self.generation_batch_size = generation_batch_size
        self.steps_per_generation = steps_per_generation
        self.num_iterations = num_iterations
        self.shuffle_dataset = shuffle_dataset
        self.seed = seed
        self.generation = generation
        self.importance_sampling = importance_sampling
        self.dynamic_sampling = dynamic_sampling
        self.chat_template_kwargs = chat_template_kwargs
        self.prompt_as_chat = prompt_as_chat
        self.system_prompt = system_prompt
        self.scale_rewards = scale_rewards
        self.multi_objective_aggregation = multi_objective_aggregation
        self.mask_truncated_completions = mask_truncated_completions
        self.num_generations_eval = num_generations if num_generations_eval is None else num_generations_eval
        self.per_device_eval_batch_size = per_device_eval_batch_size
        self.eval_sources = eval_sources(eval_dataset, dataset_config, eval_split, prompt_column, prompt_template,
                                         per_device_eval_batch_size, self.num_generations_eval)
        # Loaded now, with the reward functions' signatures checked against them: a bad dataset
        # fails here, before the model loads and before a logger creates a run.
        self.train_dataset, self.eval_datasets = load_prompt_sets(
            self.dataset_source, self.eval_sources, self.rewards.funcs, getattr(self.sampler, "rollout_fields", ())
        )
        check_system_prompt(system_prompt, prompt_as_chat, [self.train_dataset, *self.eval_datasets.values()])
        self.eval_builders: dict[str, RolloutBuilder] = {}
        #: The latest training generation batch of all ranks, when ``collect_completions`` is on.
        self.completion_table: CompletionTable | None = None
        self._collect_completions = False

        self.builder: RolloutBuilder | None = None
        self.refill: DynamicSampler | None = None  # with dynamic_sampling: draws the training prompts
        self.schedule: MicroStepSchedule | None = None
        self.prompt_order: PromptOrder | None = None
        self.micro_steps_done = 0  # micro-steps actually trained (not prefetched): the resume point
        self.num_tokens = 0
        self.buffer = GenerationBuffer()
        self.run_plan: dict[str, Any] = {}  # what a resumed run must not change (resume_state.PLAN_KEYS)

    # ------------------------------------------------------------------------------ setup
    def setup(self, stage: str) -> None:
        handle = self.trainer.lightning_module
        missing = missing_handle_members(handle)
        if missing:
            raise TypeError(
                "RolloutDataModule needs a LightningModule that implements grpo_lightning.types."
                f"PolicyHandle (such as GRPOModule); {type(handle).__name__} lacks {missing}."
            )
        if stage == "validate" and not self.eval_sources:
            raise ValueError("grpo validate needs evaluation prompts: set data.eval_dataset.")
        check_completion_fits(self.generation.max_completion_length, getattr(handle, "max_context_length", None))
        self.sampler.bind(handle)
        if self.sampler.keeps_own_weights and not any(isinstance(c, WeightSync) for c in self.trainer.callbacks):
            self.trainer.callbacks.append(WeightSync())  # the sampler's copy of the weights follows the policy
        self.rewards.to(self.trainer.strategy.root_device)  # reward models score on the training device
        if stage == "fit" and self.builder is None:
            self._setup_training(handle)
        if stage in ("fit", "validate") and not self.eval_builders:
            self._setup_evaluation(handle)

    def _setup_training(self, handle: Any) -> None:
        trainer = self.trainer
        check_trainer_settings(trainer)  # the run length too
        plan = plan_generation_batches(
            self.per_device_train_batch_size, self.num_generations, trainer.world_size,
            self.generation_batch_size, self.steps_per_generation, trainer.accumulate_grad_batches,
        )
        self.prompt_order = PromptOrder(len(self.train_dataset), plan.prompts_per_generation, self.shuffle_dataset, data_seed(self.seed))
        self.schedule = MicroStepSchedule(self.prompt_order.generations_per_epoch, plan.steps_per_generation, self.num_iterations)
        if self.schedule.steps_per_epoch % trainer.accumulate_grad_batches:
            log.warning(
                "An epoch has %d micro-steps, not a multiple of trainer.accumulate_grad_batches=%d: "
                "the last optimizer step of each epoch accumulates fewer micro-batches.",
                self.schedule.steps_per_epoch, trainer.accumulate_grad_batches,
            )
        self.run_plan = run_plan(self.train_dataset["prompt"], self.num_generations, plan, self.per_device_train_batch_size,
                                 self.num_iterations, trainer.accumulate_grad_batches, trainer.world_size,
                                 self.shuffle_dataset, self.dynamic_sampling)
        settings = self._settings(self.num_generations, plan, trainer.accumulate_grad_batches, self.num_iterations)
        if trainer.is_global_zero:
            log.info(run_summary(settings, self.schedule, trainer, handle.needs_reference_logprobs))
        self.builder = RolloutBuilder(settings, self.sampler, self.rewards, handle, trainer_collective(lambda: self.trainer))
        self.builder.collect_table = self._collect_completions
        self.refill = DynamicSampler(self.dynamic_sampling, self.builder, self._rows) if self.dynamic_sampling else None

    def _setup_evaluation(self, handle: Any) -> None:
        world = self.trainer.world_size
        rows = self.per_device_eval_batch_size
        plan = GenerationPlan(rows * world, 1, rows * world // self.num_generations_eval, rows)
        settings = self._settings(self.num_generations_eval, plan, gradient_accumulation_steps=1, num_iterations=1)
        for name, source in self.eval_sources.items():
            self.eval_builders[name] = RolloutBuilder(settings, self.sampler, self.rewards, handle, trainer_collective(lambda: self.trainer))

    def _settings(self, num_generations: int, plan: GenerationPlan, gradient_accumulation_steps: int, num_iterations: int) -> RolloutSettings:
        return RolloutSettings(
            num_generations=num_generations, plan=plan, params=self.generation,
            gradient_accumulation_steps=gradient_accumulation_steps, num_iterations=num_iterations,
            chat_template_kwargs=self.chat_template_kwargs, scale_rewards=self.scale_rewards,
            multi_objective_aggregation=self.multi_objective_aggregation, mask_truncated_completions=self.mask_truncated_completions,
            importance_sampling=self.importance_sampling, sampler_logprobs=self.sampler.provides_logprobs,
        )

    @property
    def collect_completions(self) -> bool:
        """Whether each training generation batch is gathered into ``completion_table``
        (completion loggers turn this on)."""
        return self._collect_completions

    @collect_completions.setter
    def collect_completions(self, value: bool) -> None:
        self._collect_completions = bool(value)
        if self.builder is not None:
            self.builder.collect_table = self._collect_completions

    def train_dataloader(self) -> DataLoader:
        if self.schedule is None:
            raise RuntimeError("RolloutDataModule.setup('fit') must run before train_dataloader().")
        stream = MicroStepStream(self.schedule, start_step=lambda: self.micro_steps_done)
        return DescriptorLoader(stream, position=lambda: self.micro_steps_done)

    def val_dataloader(self) -> list[DataLoader]:
        loaders = []
        for name, dataset in self.eval_datasets.items():
            plan = EvalPlan(len(dataset), self.per_device_eval_batch_size // self.num_generations_eval, self.trainer.world_size)
            loaders.append(DataLoader(EvalStream(name, plan, self.trainer.global_rank), batch_size=None, num_workers=0,
                                      generator=torch.Generator()))  # not the global RNG: training's stream stays put
        return loaders

    # ------------------------------------------------------------------ rollouts, just in time
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        if isinstance(batch, (MicroStepRef, EvalRef)):
            return batch  # a descriptor: nothing to move
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        if isinstance(batch, EvalRef):
            return self.eval_batch(batch)
        if not isinstance(batch, MicroStepRef):
            return batch
        micro_batch = self.micro_batch(batch)
        self.micro_steps_done = batch.step + 1
        return micro_batch

    def micro_batch(self, ref: MicroStepRef) -> RolloutBatch:
        """The micro-batch for ``ref``, generating its generation batch first if needed."""
        assert self.schedule is not None
        accumulate = self.trainer.accumulate_grad_batches
        first = self.schedule.window_start_ref(ref.step, accumulate)  # the buffer keeps what its replay needs
        batches, unlogged = self.buffer.batches_for(ref, first, lambda: self._generate(ref), self.trainer.strategy.root_device)
        batch = batches[ref.micro_index]
        if not (unlogged and ref.micro_index == 0 and ref.iteration == 0):
            batch = replace(batch, generation_metrics={}, prepare_seconds=0.0)
        batch.iteration = ref.iteration
        steps = window_steps(ref.step, self.schedule.steps_per_epoch, accumulate)
        return replace(batch, accumulation_steps=steps, num_items_in_batch=batch.num_items_in_batch * steps / accumulate)

    def eval_batch(self, ref: EvalRef) -> RolloutBatch:
        """Generate and score one validation step (no buffering, no shuffling)."""
        dataset = self.eval_datasets[ref.name]
        row_ids, counts = ref.rows(self.num_generations_eval)  # repeated prompts keep ranks in step, uncounted
        rows = self._rows(row_ids, dataset)
        state = build_trainer_state(self.trainer, self.micro_steps_done, self.schedule)
        order_seed = self.prompt_order.seed if self.prompt_order is not None else data_seed(self.seed)
        seed = eval_step_seed(order_seed, self.trainer.global_rank, self.trainer.global_step,
                              list(self.eval_datasets).index(ref.name), ref.step)
        with isolated_rng(seed):
            built = self.eval_builders[ref.name].build(rows, row_ids, None, trainer_state=state, counts=counts)
        prefix = f"eval_{ref.name}_" if ref.name else "eval_"
        return replace(built.micro_batches[0], metric_prefix=prefix, accumulation_steps=1)

    def _generate(self, ref: MicroStepRef) -> list[RolloutBatch]:
        assert self.builder is not None and self.prompt_order is not None
        # A private generator per generation batch: the micro-batch shuffle is reproducible on
        # resume and independent of any other use of the global RNG.
        seed = shuffle_seed(self.prompt_order.seed, self.trainer.global_rank, ref.epoch, ref.generation)
        generator, state = torch.Generator().manual_seed(seed), build_trainer_state(self.trainer, ref.step, self.schedule)
        if self.refill is not None:
            built = self.refill.build(self.prompt_order, generator, trainer_state=state)
        else:
            row_ids = self.builder.local_row_ids(self.prompt_order.prompt_indices(ref.epoch, ref.generation))
            built = self.builder.build(self._rows(row_ids), row_ids, generator, trainer_state=state)
        self.num_tokens += built.num_tokens
        if built.table is not None:
            self.completion_table = built.table
        for index, micro in enumerate(built.micro_batches):
            micro.generation_index, micro.micro_index = ref.generation, index
        built.micro_batches[0].generation_metrics["num_tokens"] = float(self.num_tokens)
        return built.micro_batches

    def _rows(self, row_ids: Sequence[int], dataset: Any = None) -> list[dict[str, Any]]:
        rows = self.train_dataset if dataset is None else dataset
        return [format_row(rows[i], self.prompt_as_chat, self.system_prompt) for i in row_ids]

    def teardown(self, stage: str) -> None:
        self.sampler.close()

    # ---------------------------------------------------------------------------- resume
    def state_dict(self) -> dict[str, Any]:
        """The prompt position and data plan, and each rank's RNG streams and generation buffer
        (gathered: every rank calls this when a checkpoint is written, rank 0 saves it); inside an
        accumulation window, from its start (``utils/accumulation_window.py``)."""
        seed = self.prompt_order.seed if self.prompt_order is not None else None
        position = resume_position(self.micro_steps_done, self.trainer)
        ranks = trainer_collective(lambda: self.trainer).gather_objects([self.buffer.rank_state(position)])
        return {"micro_steps_done": position, "replay": position < self.micro_steps_done, "num_tokens": self.num_tokens,
                "seed": seed, "plan": self.run_plan, "ranks": ranks, "refill": self.refill.state_dict() if self.refill else None,
                "completion_table": table_state(self.completion_table)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_same_plan(state_dict.get("plan"), self.run_plan)
        self.micro_steps_done = int(state_dict["micro_steps_done"])
        self.num_tokens = int(state_dict["num_tokens"])
        if self.prompt_order is not None and self.seed is None:  # the order's seed came from the global seed
            self.prompt_order = resumed_prompt_order(self.prompt_order, state_dict.get("seed"))
        self.completion_table = table_from_state(state_dict.get("completion_table"))
        if self.refill is not None:  # the run plan says the checkpoint's run sampled dynamically too
            self.refill.load_state_dict(state_dict["refill"])
        ranks = state_dict.get("ranks")
        replay = state_dict.get("replay", state_dict.get("in_flight"))  # "in_flight": its former name
        self.buffer.resume_from(ranks[self.trainer.global_rank] if ranks else None, bool(replay))

