"""One generation batch: prompts → completions → rewards → advantages → micro-batches.

Spec §1.5 in order. The builder is plain torch with an injected :class:`Collective`, so that the
Lightning datamodule (and tests) decide how ranks talk to each other.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from grpo_lightning.algo.advantages import AdvantageResult, compute_advantages_with_stats, reward_metrics
from grpo_lightning.algo.importance import (
    ImportanceSamplingCorrection, importance_sampling_weights, sampling_metrics, sampling_stats,
)
from grpo_lightning.data.agent_wiring import gathered_tool_metrics, start_agent_batch
from grpo_lightning.data.collective import Collective
from grpo_lightning.data.collate import pad_sequences, shuffle_and_split
from grpo_lightning.data.completion_metrics import completion_metrics
from grpo_lightning.data.counted_rows import exclude_rows, score_counted_rows
from grpo_lightning.data.multimodal import (
    attach_model_inputs, check_sampler_images, encode_row_prompt, image_column, row_inputs_of,
)
from grpo_lightning.data.prompt_format import check_context_length, decode_completions
from grpo_lightning.data.prompt_order import GenerationPlan
from grpo_lightning.data.sampling import generate_checked, with_rollout_fields
from grpo_lightning.data.sources import is_conversational
from grpo_lightning.rewards.runner import RewardRunner, RewardScores
from grpo_lightning.rewards.timeouts import gathered_timeout_metrics
from grpo_lightning.samplers.base import Sampler
from grpo_lightning.types import CompletionTable, GenerationParams, PolicyHandle, Rollout, RolloutBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutSettings:
    """The data-side knobs a generation batch depends on."""

    num_generations: int
    plan: GenerationPlan
    params: GenerationParams
    gradient_accumulation_steps: int
    num_iterations: int = 1
    chat_template_kwargs: dict[str, Any] | None = None
    scale_rewards: str | bool = "group"
    multi_objective_aggregation: str = "sum_then_normalize"
    mask_truncated_completions: bool = False
    importance_sampling: ImportanceSamplingCorrection = ImportanceSamplingCorrection()
    # Whether the sampler returns per-token log-probs (``Sampler.provides_logprobs``).
    sampler_logprobs: bool = False

    @property
    def needs_old_logprobs(self) -> bool:
        """Old log-probs differ from the live ones only if an optimizer step can fall between
        generating a batch and training on it (TRL: ``GA % (S * num_iterations) != 0``)."""
        return self.gradient_accumulation_steps % (self.plan.steps_per_generation * self.num_iterations) != 0

    @property
    def generation_starts_window(self) -> bool:
        """Every generation batch begins an accumulation window (``GA`` divides ``S ×
        num_iterations``): the previous window's gradients are already dropped when it runs."""
        return (self.plan.steps_per_generation * self.num_iterations) % self.gradient_accumulation_steps == 0

    @property
    def corrects_sampling(self) -> bool:
        """The importance-sampling correction applies: it is on and the sampler reports log-probs."""
        return self.importance_sampling.enabled and self.sampler_logprobs

    @property
    def computes_old_logprobs(self) -> bool:
        """The trainer's log-probs are computed at generation time: needed by the loss, or as the
        target of the importance-sampling correction."""
        return self.needs_old_logprobs or self.corrects_sampling


@dataclass
class SampledRows:
    """One rank's generated and scored rows, before advantages: ``rollouts`` and their ``scores``
    (``scores.rewards``: ``(B, F)``), in row order."""

    rollouts: list[Rollout]
    scores: RewardScores


@dataclass
class GenerationBatch:
    """A built generation batch: its micro-batches, the tokens it added to ``num_tokens`` and,
    when asked for, the completion table of all ranks."""

    micro_batches: list[RolloutBatch]
    num_tokens: int
    table: CompletionTable | None = None


class RolloutBuilder:
    """Builds the micro-batches of one generation batch on one rank."""

    def __init__(
        self,
        settings: RolloutSettings,
        sampler: Sampler,
        rewards: RewardRunner,
        handle: PolicyHandle,
        collective: Collective = Collective(),
    ) -> None:
        self.settings = settings
        self.sampler = sampler
        self.rewards = rewards
        self.handle = handle
        self.collective = collective
        #: Gather prompts, completions, rewards and advantages of every generation batch into a
        #: :class:`CompletionTable` (costs a gather of texts; turned on by completion loggers).
        self.collect_table = False
        self._warned_all_none: set[str] = set()

    def local_row_ids(self, prompts: Sequence[int]) -> list[int]:
        """This rank's rows of a generation batch of ``prompts`` (dataset row ids): every prompt
        ``num_generations`` times, cut into contiguous per-rank slices (spec §1.3)."""
        rows, rank = self.settings.plan.local_rows, self.collective.rank
        global_ids = [i for i in prompts for _ in range(self.settings.num_generations)]
        return global_ids[rank * rows : (rank + 1) * rows]

    def build(
        self, rows: Sequence[dict[str, Any]], row_ids: Sequence[int], generator: torch.Generator | None,
        trainer_state: Any = None, counts: Sequence[bool] | None = None,
    ) -> GenerationBatch:
        """``rows``: this rank's dataset rows, one per completion (already repeated G times).

        ``counts``: per row, whether it counts; ``None`` = all do. A row that does not count (an
        evaluation row repeated only to keep ranks in step) is generated but never scored, left
        out of every metric and the advantage statistics, and has advantage 0 and an empty loss
        mask. Whole groups must agree, and every rank must pass ``counts`` or none.
        """
        started = time.perf_counter()
        return self.finish(self.sample(rows, row_ids, trainer_state, counts), generator, counts, started)

    def sample(
        self, rows: Sequence[dict[str, Any]], row_ids: Sequence[int], trainer_state: Any = None,
        counts: Sequence[bool] | None = None,
    ) -> SampledRows:
        """Generate and score this rank's ``rows`` (the first half of :meth:`build`)."""
        s, tokenizer = self.settings, self.handle.tokenizer
        rows, agent = start_agent_batch(self.sampler, rows)  # agents: each rollout's environment reset, its tools
        prompts = [row["prompt"] for row in rows]
        rollouts = self._generate(rows, row_ids) if agent is None else agent.generate(self.handle, s, row_ids)
        completion_ids = [r.completion_ids for r in rollouts]
        conversational = is_conversational(prompts[0])
        completions = decode_completions(completion_ids, tokenizer, conversational) if agent is None else agent.completions()
        columns = {k: [row[k] for row in rows] for k in rows[0] if k not in ("prompt", "completion", "completion_ids")}
        columns = with_rollout_fields(columns, rollouts)
        scores = score_counted_rows(
            self.rewards, counts, prompts=prompts, completions=completions, completion_ids=completion_ids,
            columns=columns, trainer_state=trainer_state, environments=agent and agent.environments,
        )
        return SampledRows(rollouts, scores)

    def finish(
        self, sampled: SampledRows, generator: torch.Generator | None, counts: Sequence[bool] | None = None,
        started: float | None = None, extra_metrics: dict[str, float] | None = None,
    ) -> GenerationBatch:
        """Advantages, padding, normalisers, old/reference log-probs, metrics and micro-batches of
        scored rows (the second half of :meth:`build`); ``extra_metrics`` join the generation
        metrics. Every rank calls it, with ``counts`` on all ranks or none."""
        started = time.perf_counter() if started is None else started
        s, device = self.settings, self.handle.device
        rollouts, scores = sampled.rollouts, sampled.scores
        # Group statistics need every rank's rewards (a group may straddle two ranks).
        global_rewards = self.collective.gather_rows(scores.rewards.to(device))  # (N, F)
        counted = None if counts is None else self.collective.gather_rows(torch.tensor(counts, device=device).float()) > 0
        advantages, stats = self._advantages(global_rewards, counted)  # (N,), stats of counted rows
        local = slice(self.collective.rank * len(rollouts), (self.collective.rank + 1) * len(rollouts))
        batch = self._pad(rollouts, advantages[local], device)
        if counted is not None:
            exclude_rows(batch, ~counted[local])
            batch.counted = counted[local]
        loss_mask = batch.loss_mask
        # Loss tokens per optimizer step over all ranks: one generation batch covers S micro-steps
        # and an optimizer step GA of them (the dapo/cispo/vespo normaliser, TRL 1.16).
        tokens = self.collective.gather_rows(loss_mask.sum().reshape(1).float()).sum()
        batch.num_items_in_batch = tokens * s.gradient_accumulation_steps / s.plan.steps_per_generation
        chunk = s.plan.local_rows // s.plan.steps_per_generation  # per_device_train_batch_size
        correcting = s.corrects_sampling and batch.sampling_logps is not None
        if s.needs_old_logprobs or correcting:
            batch.old_logps = self.handle.rollout_logprobs(batch, reference=False, chunk_size=chunk)
        if self.handle.needs_reference_logprobs:
            batch.ref_logps = self.handle.rollout_logprobs(batch, reference=True, chunk_size=chunk)

        metrics, num_tokens = self._metrics(rollouts, batch, global_rewards, scores, stats, counted)
        metrics.update(extra_metrics or {})
        if correcting:
            rows = None if counted is None else counted[local]
            metrics.update(self._correct_sampling(batch, rows))
        micro_batches = shuffle_and_split(batch, s.plan.steps_per_generation, generator)
        micro_batches[0] = replace(
            micro_batches[0], generation_metrics=metrics, prepare_seconds=time.perf_counter() - started
        )
        table = self._table(rollouts, scores, advantages[local]) if self.collect_table else None
        return GenerationBatch(micro_batches, num_tokens, table)

    def _correct_sampling(self, batch: RolloutBatch, rows: torch.Tensor | None) -> dict[str, float]:
        """Set ``batch.sampling_is_weights`` (spec §3.8) and return the ``sampling/*`` metrics of
        all ranks. ``rows``: ``(B,)`` bool, the local rows that count (``None``: all)."""
        assert batch.old_logps is not None and batch.sampling_logps is not None
        mask = batch.loss_mask
        correction = self.settings.importance_sampling
        weights = importance_sampling_weights(batch.old_logps, batch.sampling_logps, mask, correction)
        batch.sampling_is_weights = weights  # (B, T) or (B, 1)
        local = sampling_stats(batch.old_logps, batch.sampling_logps, mask, weights, correction.per_sequence, rows)
        per_rank = self.collective.gather_rows(local.as_tensor().to(batch.advantages.device).unsqueeze(0))  # (P, 7)
        return sampling_metrics(per_rank.cpu())

    def _advantages(
        self, global_rewards: torch.Tensor, counted: torch.Tensor | None
    ) -> tuple[torch.Tensor, AdvantageResult]:
        """``(N,)`` advantages (0 for rows that do not count) and the statistics of counted rows,
        computed over the counted rows alone (so a batch-wide std never sees repeated rows)."""
        s = self.settings
        rewards = global_rewards if counted is None else global_rewards[counted]
        stats = compute_advantages_with_stats(
            rewards, s.num_generations, self.rewards.weights.to(rewards.device), s.scale_rewards,
            s.multi_objective_aggregation,
        )
        if counted is None:
            return stats.advantages, stats
        advantages = torch.zeros(len(global_rewards), dtype=stats.advantages.dtype, device=global_rewards.device)
        advantages[counted] = stats.advantages
        return advantages, stats

    def _table(self, rollouts: list[Rollout], scores: Any, advantages: torch.Tensor) -> CompletionTable:
        tokenizer = self.handle.tokenizer
        columns: dict[str, list[Any]] = {
            "prompt": tokenizer.batch_decode([r.prompt_ids for r in rollouts], skip_special_tokens=True),
            "completion": tokenizer.batch_decode([r.completion_ids for r in rollouts], skip_special_tokens=True),
        }
        for column, name in enumerate(scores.names):
            columns[f"reward/{name}"] = scores.rewards[:, column].tolist()
        columns["advantage"] = advantages.tolist()
        if (images := image_column(rollouts)) is not None:  # CompletionLogger(log_multimodal) logs them
            columns["image"] = images
        for name, values in sorted(scores.extra_columns.items()):
            if len(values) == len(rollouts):  # log_extra values must be one per completion
                columns[name] = list(values)
            else:
                log.warning("log_extra column %r has %d values for %d completions: left out of the "
                            "completion table.", name, len(values), len(rollouts))
        gathered = {name: self.collective.gather_objects(values) for name, values in columns.items()}
        return CompletionTable(step=self.handle.policy_version, columns=gathered)

    def _generate(self, rows: Sequence[dict[str, Any]], row_ids: Sequence[int]) -> list[Rollout]:
        s, tokenizer = self.settings, self.handle.tokenizer
        encode = lambda i: encode_row_prompt(rows[i], row_ids[i], tokenizer, s.chat_template_kwargs)  # noqa: E731
        # Consecutive rows of the same prompt form runs; whole groups are generated with
        # num_generations per prompt, a group cut by a rank boundary row by row.
        starts = [i for i in range(len(row_ids)) if i == 0 or row_ids[i] != row_ids[i - 1]]
        runs = [b - a for a, b in zip(starts, starts[1:] + [len(row_ids)])]
        if all(n == s.num_generations for n in runs):
            unique = [encode(i) for i in starts]  # images: MultimodalPrompt (ids + pixel inputs)
            self._check_prompts(unique, [row_ids[i] for i in starts])
            return attach_model_inputs(generate_checked(self.sampler, self.handle, unique, s.num_generations, s.params),
                                       unique, s.num_generations)
        per_row = [encode(i) for i in range(len(rows))]
        self._check_prompts(per_row, row_ids)
        return attach_model_inputs(generate_checked(self.sampler, self.handle, per_row, 1, s.params), per_row, 1)

    def _check_prompts(self, prompts: Sequence[Any], row_ids: Sequence[int]) -> None:
        """Before any compute: the sampler takes the prompts' images, and each prompt (its image
        tokens counted) leaves room for ``max_completion_length`` in the model's context."""
        check_sampler_images(self.sampler, prompts)
        check_context_length(prompts, row_ids, self.settings.params.max_completion_length,
                             getattr(self.handle, "max_context_length", None))  # None: the model states no limit

    def _pad(self, rollouts: list[Rollout], advantages: torch.Tensor, device: torch.device) -> RolloutBatch:
        s, tokenizer = self.settings, self.handle.tokenizer
        pad = tokenizer.pad_token_id
        prompt_ids, prompt_mask = pad_sequences([r.prompt_ids for r in rollouts], value=pad, side="left")
        completion_ids, completion_mask = pad_sequences([r.completion_ids for r in rollouts], value=pad, side="right")
        tool_mask = None
        if any(r.tool_mask is not None for r in rollouts):
            masks = [r.tool_mask if r.tool_mask is not None else [1] * len(r.completion_ids) for r in rollouts]
            tool_mask, _ = pad_sequences(masks, value=1, side="right")
        sampling_logps = None
        if all(r.sampling_logprobs is not None for r in rollouts):
            sampling_logps, _ = pad_sequences(
                [r.sampling_logprobs for r in rollouts], value=0.0, side="right", dtype=torch.float32
            )
        if s.mask_truncated_completions:
            truncated = self._truncated(rollouts)
            completion_mask[truncated] = 0
            if tool_mask is not None:
                tool_mask[truncated] = 0
        batch = RolloutBatch(
            prompt_ids=prompt_ids,
            prompt_mask=prompt_mask,
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            advantages=advantages.float(),
            num_items_in_batch=torch.tensor(0.0),
            policy_versions=torch.tensor([r.policy_version for r in rollouts], dtype=torch.long),
            temperature=s.params.temperature,
            max_completion_length=s.params.max_completion_length,
            tool_mask=tool_mask,
            sampling_logps=sampling_logps,
            model_inputs=row_inputs_of(rollouts),  # images: per-row pixel inputs
        )
        return batch.to(device)

    @staticmethod
    def _truncated(rollouts: list[Rollout]) -> torch.Tensor:
        """Truncated iff generation did not stop on an end-of-sequence id (the sampler knows every
        id that ends a turn; TRL's rule, "last id is not the tokenizer's EOS or pad", counts a
        chat model's end-of-turn id as truncation)."""
        return torch.tensor([not r.ended_on_eos for r in rollouts], dtype=torch.bool)

    def _metrics(
        self, rollouts: list[Rollout], batch: RolloutBatch, global_rewards: torch.Tensor, scores: Any, stats: Any,
        counted: torch.Tensor | None = None,
    ) -> tuple[dict[str, float], int]:
        """Generation-side metrics over the rows that count (``counted``, ``(N,)`` bool; all if None)."""
        device = batch.advantages.device
        # Lengths count policy tokens only (tool-inserted tokens excluded), masked or not.
        local_lengths = torch.tensor(
            [sum(r.tool_mask) if r.tool_mask is not None else len(r.completion_ids) for r in rollouts],
            dtype=torch.float32, device=device,
        )
        lengths = self.collective.gather_rows(local_lengths)
        truncated = self.collective.gather_rows(self._truncated(rollouts).float().to(device)).bool()
        if counted is not None:
            lengths, truncated, global_rewards = lengths[counted], truncated[counted], global_rewards[counted]
        metrics = completion_metrics(lengths.cpu(), truncated.cpu())
        metrics.update(reward_metrics(global_rewards.cpu(), scores.names, stats))
        # Completions that no reward function applies to get advantage 0 (spec §2.3).
        missing = global_rewards.isnan()  # (N, F)
        metrics["frac_reward_none"] = missing.all(dim=1).float().mean().item()
        for column, name in enumerate(scores.names):
            metrics[f"rewards/{name}/frac_none"] = missing[:, column].float().mean().item()
            if missing[:, column].all() and name not in self._warned_all_none:
                self._warned_all_none.add(name)
                log.warning(
                    "reward function %r returned None for every completion of a generation batch: "
                    "it shapes no advantage. If that is not intended, check that it reads the right dataset "
                    "columns (rewards/%s/frac_none tracks this).", name, name,
                )
        metrics.update(self._logged_metrics(scores.logged_metrics, device))
        metrics.update(gathered_tool_metrics(rollouts, self.collective.gather_rows, counted, device))  # agents: tools/*
        if any(limit is not None for limit in self.rewards.timeouts):  # rewards/<name>/frac_timeout, all ranks
            c = self.collective
            scored = len(rollouts) if counted is None else int(counted.view(c.world_size, -1)[c.rank].sum())
            metrics.update(gathered_timeout_metrics(scores.timed_out, scored, c.gather_rows, scores.names,
                                                    self.rewards.timeouts, device))
        local_tokens = batch.prompt_mask.sum() + local_lengths.sum()
        num_tokens = int(self.collective.gather_rows(local_tokens.reshape(1).float()).sum().item())
        return metrics, num_tokens

    def _logged_metrics(self, logged: dict[str, list[float]], device: torch.device) -> dict[str, float]:
        """``log_metric`` values: the mean of every value pushed on any rank, each value counted
        once (TRL 1.16 gathers ``(sum, count)`` per name). Names are gathered first, in sorted
        order, so that every rank reduces the same names even if it logged none of them."""
        names = sorted(set(self.collective.gather_objects(sorted(logged))))
        if not names:
            return {}
        local = torch.tensor(
            [[sum(logged.get(n, [])), len(logged.get(n, []))] for n in names], dtype=torch.float32, device=device
        )  # (M, 2)
        totals = self.collective.gather_rows(local.unsqueeze(0)).sum(0)  # (P, M, 2) -> (M, 2)
        return {n: total / count if count else float("nan") for n, (total, count) in zip(names, totals.tolist())}
