"""Dynamic sampling (DAPO): train only on groups whose rewards differ, refilled from the prompt order.

A group whose completions all get the same reward has advantage 0 on every row: it gives the
policy loss nothing to learn from and only dilutes the batch. With dynamic sampling on, such
groups are dropped from a training generation batch and further *rounds* are generated, each a
whole generation batch of the next prompts of the run's order, until the batch again holds its
planned number of groups (the per-step batch size never changes). Layer L4 (data side), plain
torch: ranks talk through the builder's :class:`~grpo_lightning.data.rollout_builder.Collective`,
and every decision is taken on the gathered rewards, so all ranks take the same one.

The prompts come from a cursor over the run's prompt order (``batches_drawn``: prompt batches
consumed so far, saved in checkpoints), so a resumed run draws the same extra prompts. While no
group ties, generation batch ``k`` draws prompt batch ``k``: exactly the prompts, rows and
micro-batches of a run without dynamic sampling.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence

import torch

from grpo_lightning.algo.stats import nanstd
from grpo_lightning.data.prompt_order import PromptOrder
from grpo_lightning.data.rollout_builder import GenerationBatch, RolloutBuilder, SampledRows
from grpo_lightning.errors import ConfigError
from grpo_lightning.rewards.runner import RewardScores

log = logging.getLogger(__name__)

ON_EXHAUSTED_CHOICES = ("pad", "error")


@dataclass(frozen=True)
class DynamicSampling:
    """Dynamic sampling (DAPO): drop the groups whose rewards all tie and refill the batch.

    Each training generation batch is generated as usual; groups whose rewards tie are dropped
    and another round of prompts (a whole generation batch of the next prompts of the run's
    order) is generated and scored, until the batch holds its planned number of groups whose
    rewards differ. Surplus groups of the last round are discarded (they would be stale by the
    next batch). See ``docs/dynamic_sampling.md``.

    Args:
        max_extra_rounds: Most rounds generated after the first for one generation batch (>= 0;
            ``0`` only drops tied groups). Each round costs a generation batch of sampling.
        on_exhausted: When the extra rounds are spent and fewer groups differ than the batch
            needs: ``pad`` tops the batch up with tied groups left out of the loss (advantage 0,
            empty loss mask: never trained on; ``dynamic_sampling/padded_groups`` counts them);
            ``error`` stops the run (verl's ``max_num_gen_batches``).
    """

    max_extra_rounds: int = 3
    on_exhausted: Literal["pad", "error"] = "pad"

    def __post_init__(self) -> None:
        rounds = self.max_extra_rounds
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
            raise ConfigError(
                f"data.dynamic_sampling.max_extra_rounds={rounds!r}: it must be an integer >= 0 (rounds generated "
                "after the first when groups tie; 0 only drops them)."
            )
        if self.on_exhausted not in ON_EXHAUSTED_CHOICES:
            raise ConfigError(
                f"data.dynamic_sampling.on_exhausted={self.on_exhausted!r}: choose one of {list(ON_EXHAUSTED_CHOICES)}."
            )

    def plan(self) -> dict[str, Any]:
        """The settings as plain values, for the run plan a resume must keep."""
        return asdict(self)


def tied_groups(
    rewards: torch.Tensor, num_generations: int, reward_weights: torch.Tensor | Sequence[float] | None = None,
    multi_objective_aggregation: str = "sum_then_normalize",
) -> torch.Tensor:
    """Which groups' rewards tie, so that all their advantages are 0 (spec §2).

    ``sum_then_normalize``: the group's weighted rewards ``Σ_f w_f R_f`` have an unbiased nanstd
    ``σ_g`` with ``isclose(σ_g, 0)`` (the test behind ``frac_reward_zero_std`` with
    ``scale_rewards: group``), or ``σ_g`` is undefined (fewer than two scorable completions).
    ``normalize_then_sum`` (GDPO): that holds for every reward function of non-zero weight.

    Args:
        rewards: ``(N, F)`` reward matrix, group-major, NaN = not applicable (``(N,)``: ``F = 1``).
        num_generations: ``G``.
        reward_weights: ``(F,)``; ``None`` = all ones.
        multi_objective_aggregation: As ``data.multi_objective_aggregation``.

    Returns:
        ``(N/G,)`` bool, on the CPU.

    >>> tied_groups(torch.tensor([[1.0], [1.0], [0.0], [1.0], [float("nan")], [2.0]]), 2).tolist()
    [True, False, True]
    """
    values = rewards.detach().double().cpu()
    if values.dim() == 1:
        values = values.unsqueeze(1)
    n, f = values.shape
    weights = torch.ones(f, dtype=torch.float64) if reward_weights is None else torch.as_tensor(
        reward_weights, dtype=torch.float64).cpu()
    if multi_objective_aggregation == "normalize_then_sum":
        std = nanstd(values.view(n // num_generations, num_generations, f), dim=1)  # (N/G, F)
        flat = std.isnan() | torch.isclose(std, torch.zeros_like(std))
        return flat[:, weights != 0].all(dim=1)
    weighted = (values * weights).nansum(dim=1)  # (N,)
    weighted[values.isnan().all(dim=1)] = float("nan")
    std = nanstd(weighted.view(-1, num_generations), dim=1)  # (N/G,)
    return std.isnan() | torch.isclose(std, torch.zeros_like(std))


@dataclass(frozen=True)
class GroupChoice:
    """The groups of one generation batch, as ``(round, group in round)`` in batch order: the first
    groups whose rewards differ in draw order, then (cap reached) ``padded`` tied ones at the end."""

    picks: list[tuple[int, int]]
    rounds: int
    dropped: int  # tied groups sampled for this batch (none of them trained on)
    surplus: int  # differing groups sampled beyond the batch's need, discarded
    padded: int  # tied groups in the batch as loss-free filler (the cap was reached)

    def metrics(self) -> dict[str, float]:
        return {"dynamic_sampling/rounds": float(self.rounds), "dynamic_sampling/dropped_groups": float(self.dropped),
                "dynamic_sampling/surplus_groups": float(self.surplus),
                "dynamic_sampling/padded_groups": float(self.padded)}


def choose_groups(tied: Sequence[torch.Tensor], needed: int) -> GroupChoice:
    """Pick ``needed`` groups from the rounds' tie flags (``tied[r]``: ``(groups,)`` bool).

    >>> choice = choose_groups([torch.tensor([True, False]), torch.tensor([False, False])], 2)
    >>> choice.picks, choice.dropped, choice.surplus, choice.padded
    ([(0, 1), (1, 0)], 1, 1, 0)
    """
    differing = [(r, j) for r, flags in enumerate(tied) for j, t in enumerate(flags.tolist()) if not t]
    ties = [(r, j) for r, flags in enumerate(tied) for j, t in enumerate(flags.tolist()) if t]
    picks = differing[:needed]
    padded = needed - len(picks)
    return GroupChoice(picks + ties[:padded], len(tied), len(ties), len(differing) - len(picks), padded)


@dataclass
class _Round:
    sampled: SampledRows  # this rank's rows of the round
    rewards: torch.Tensor  # (N, F) every rank's rewards, CPU
    tied: torch.Tensor  # (N/G,) bool


@dataclass
class DynamicSampler:
    """Builds training generation batches with dynamic sampling on one rank.

    ``rows_of(row_ids)`` gives the formatted dataset rows. ``batches_drawn`` (prompt batches of
    the order consumed) is the resume position: :meth:`state_dict` / :meth:`load_state_dict`.
    """

    settings: DynamicSampling
    builder: RolloutBuilder
    rows_of: Callable[[Sequence[int]], list[dict[str, Any]]]
    batches_drawn: int = 0
    _warned: bool = field(default=False, init=False, repr=False)  # the cap warning is logged once
    # batches_drawn when the running build started: a checkpoint written while it runs (on_exception:
    # a sampler or reward failed) resumes before it, as the random streams do (GenerationBuffer)
    _drawn_before_build: int | None = field(default=None, init=False, repr=False)

    def draw(self, order: PromptOrder) -> list[int]:
        """The next prompt batch of ``order`` (epoch after epoch)."""
        epoch, generation = divmod(self.batches_drawn, order.generations_per_epoch)
        self.batches_drawn += 1
        return order.prompt_indices(epoch, generation)

    def build(self, order: PromptOrder, generator: torch.Generator | None, trainer_state: Any = None) -> GenerationBatch:
        """One generation batch of groups whose rewards differ (or, cap reached, as :class:`DynamicSampling` says)."""
        started, self._drawn_before_build = time.perf_counter(), self.batches_drawn
        b, s = self.builder, self.builder.settings
        needed = s.plan.prompts_per_generation
        rounds: list[_Round] = []
        while True:
            row_ids = b.local_row_ids(self.draw(order))
            sampled = b.sample(self.rows_of(row_ids), row_ids, trainer_state)
            rewards = b.collective.gather_rows(sampled.scores.rewards.to(b.handle.device)).cpu()  # (N, F)
            tied = tied_groups(rewards, s.num_generations, b.rewards.weights, s.multi_objective_aggregation)
            rounds.append(_Round(sampled, rewards, tied))
            differing = sum(int((~r.tied).sum()) for r in rounds)
            if differing >= needed or len(rounds) > self.settings.max_extra_rounds:
                break
        choice = choose_groups([r.tied for r in rounds], needed)
        if choice.padded:
            self._exhausted(choice, needed)
        sampled, counts = self._assemble(rounds, choice)
        built = b.finish(sampled, generator, counts, started, choice.metrics())
        self._drawn_before_build = None
        return built

    def _exhausted(self, choice: GroupChoice, needed: int) -> None:
        found = needed - choice.padded
        message = (f"dynamic sampling: after {choice.rounds - 1} extra round(s) only {found} of the {needed} groups of a "
                   f"generation batch have rewards that differ")
        if self.settings.on_exhausted == "error":
            raise ConfigError(
                f"{message} (data.dynamic_sampling.on_exhausted='error'). Raise data.dynamic_sampling.max_extra_rounds, "
                "set on_exhausted: pad (tied groups fill the batch, left out of the loss), or use prompts and rewards "
                "on which completions differ more often (a higher data.generation.temperature, harder prompts)."
            )
        if not self._warned:
            self._warned = True
            log.warning("%s: %d tied groups fill the batch, left out of the loss (dynamic_sampling/padded_groups "
                        "counts them; raise data.dynamic_sampling.max_extra_rounds to sample more).", message, choice.padded)

    def _assemble(self, rounds: list[_Round], choice: GroupChoice) -> tuple[SampledRows, list[bool] | None]:
        """This rank's rows of the chosen groups, and which of them count (``None``: all)."""
        b, s = self.builder, self.builder.settings
        g, local, rank = s.num_generations, s.plan.local_rows, b.collective.rank
        if choice.picks == [(0, j) for j in range(s.plan.prompts_per_generation)]:
            return rounds[0].sampled, None  # the first round as drawn: every rank keeps its rows
        # Global rows (round, row) group by group; rank r trains rows [r*L, (r+1)*L) of them.
        order = [(r, j * g + k) for r, j in choice.picks for k in range(g)]
        mine = order[rank * local : (rank + 1) * local]
        used = sorted({r for r, _ in order})  # the same rounds on every rank: the same collectives
        gathered = {r: b.collective.gather_objects([(rounds[r].sampled.rollouts, rounds[r].sampled.scores.extra_columns)])
                    for r in used}  # per round: one (rollouts, log_extra columns) per rank
        rollouts = {r: [x for per_rank, _ in gathered[r] for x in per_rank] for r in used}
        columns = _row_columns(gathered)
        logged: dict[str, list[float]] = {}
        for one in rounds:  # log_metric values of every scoring call (averaged over ranks later)
            for name, values in one.sampled.scores.logged_metrics.items():
                logged.setdefault(name, []).extend(values)
        scores = RewardScores(
            rewards=torch.stack([rounds[r].rewards[i] for r, i in mine]),  # (L, F)
            names=rounds[0].sampled.scores.names, logged_metrics=logged,
            extra_columns={name: [by_row[key] for key in mine] for name, by_row in columns.items()},
        )
        counted_groups = len(choice.picks) - choice.padded
        counts = None if not choice.padded else [i // g < counted_groups for i in range(rank * local, (rank + 1) * local)]
        return SampledRows([rollouts[r][i] for r, i in mine], scores), counts

    def state_dict(self) -> dict[str, int]:
        """The resume position: the prompt batches drawn, not counting a build that is running."""
        drawn = self.batches_drawn if self._drawn_before_build is None else self._drawn_before_build
        return {"batches_drawn": drawn}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.batches_drawn, self._drawn_before_build = int(state["batches_drawn"]), None


def _row_columns(gathered: Mapping[int, list[tuple[list[Any], dict[str, list[Any]]]]]) -> dict[str, dict[tuple[int, int], Any]]:
    """``log_extra`` columns as ``{name: {(round, global row): value}}`` (``None`` where a round
    lacks the column). A column without one value per completion is left out, as the completion
    table does."""
    out: dict[str, dict[tuple[int, int], Any]] = {}
    bad: set[str] = set()
    for r, per_rank in gathered.items():
        start = 0
        for rollouts, columns in per_rank:
            for name, values in columns.items():
                if len(values) != len(rollouts):
                    bad.add(name)
                    continue
                out.setdefault(name, {}).update({(r, start + i): v for i, v in enumerate(values)})
            start += len(rollouts)
    for name in sorted(bad):
        log.warning("log_extra column %r does not have one value per completion: left out of the completion table.", name)
        out.pop(name, None)
    rows = {(r, i) for r, per_rank in gathered.items() for i in range(sum(len(x) for x, _ in per_rank))}
    return {name: {key: by_row.get(key) for key in rows} for name, by_row in out.items()}


__all__ = ["DynamicSampler", "DynamicSampling", "GroupChoice", "choose_groups", "tied_groups"]
