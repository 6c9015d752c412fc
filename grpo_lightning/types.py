"""Shared typed records: the contract between the data side, the samplers and the module.

Layer L0: imports torch and the standard library only.

Notation used in shape comments throughout the package:
``B`` rows of a (micro-)batch, ``T`` padded completion width, ``Tp`` padded prompt width,
``G`` = ``num_generations``, ``F`` = number of reward sources, ``N`` rows of a global generation batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, ContextManager, Literal, Protocol, Sequence, runtime_checkable

import torch


@dataclass(frozen=True)
class GenerationParams:
    """Sampling settings shared by every sampler back-end (TRL's generation fields).

    Args:
        max_completion_length: Maximum number of new tokens per completion. Also the ``dr_grpo``
            normaliser constant.
        temperature: Sampling temperature. The training log-probs are computed from logits divided
            by the same temperature, so the policy being optimised is the one that sampled.
        top_p: Nucleus sampling mass.
        top_k: Keep the ``top_k`` most likely tokens; 0 disables (-1, vLLM's old spelling, is read as 0).
        min_p: Minimum token probability relative to the most likely one; ``None`` disables.
        repetition_penalty: HF/vLLM repetition penalty; 1.0 disables.
        generation_kwargs: Extra back-end settings (``GenerationConfig`` / ``SamplingParams`` keys, e.g.
            ``no_repeat_ngram_size``). Keys that repeat a field above, change the group size or
            sample greedily are refused at start-up (docs/samplers.md).
    """

    max_completion_length: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.max_completion_length < 1:
            raise ValueError(
                f"data.generation.max_completion_length={self.max_completion_length}: it must be at least 1 token."
            )
        if self.temperature <= 0:
            raise ValueError(
                f"data.generation.temperature={self.temperature}: it must be > 0 (the training log-probs divide the "
                "logits by it). For near-greedy sampling use a small value such as 0.01."
            )
        if self.top_k == -1:  # vLLM's older spelling of "disabled"
            object.__setattr__(self, "top_k", 0)
        ranges = (
            ("top_p", self.top_p, 0 < self.top_p <= 1, "in (0, 1]; 1.0 disables it"),
            ("top_k", self.top_k, self.top_k >= 0, ">= 0; 0 (or -1) disables it"),
            ("min_p", self.min_p, self.min_p is None or 0 <= self.min_p <= 1, "in [0, 1], or null to disable it"),
            ("repetition_penalty", self.repetition_penalty, self.repetition_penalty > 0, "> 0; 1.0 disables it"),
        )
        for name, value, valid, rule in ranges:
            if not valid:
                raise ValueError(f"data.generation.{name}={value}: it must be {rule}.")


@dataclass
class MetricValue:
    """A metric that can be reduced exactly across ranks and micro-steps.

    ``reduce="mean"``: ``total`` is a local sum and ``count`` its local denominator; the global value
    is ``sum(total) / sum(count)`` over ranks. ``reduce="min"``/``"max"``: ``total`` is the local
    extreme (NaN when there is none) and ``count`` is unused.
    """

    total: torch.Tensor
    count: torch.Tensor
    reduce: Literal["mean", "min", "max"] = "mean"

    def local(self) -> float:
        """The value on this rank alone."""
        if self.reduce == "mean":
            count = float(self.count)
            return float(self.total) / count if count > 0 else float("nan")
        return float(self.total)


@dataclass
class Rollout:
    """One sampled completion, exactly as the sampler produced it (token in, token out).

    ``completion_ids`` are the ids trained on: never decoded and re-tokenized.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    # True when generation stopped on an EOS token (the completion ends with it), False when cut
    # by ``max_completion_length``.
    ended_on_eos: bool
    # Optimizer step (``trainer.global_step``) of the weights that produced this completion.
    policy_version: int
    # Per-token log-probs reported by the sampler (vLLM), aligned with ``completion_ids``.
    sampling_logprobs: list[float] | None = None
    # 1 for tokens the policy generated, 0 for tokens inserted by tools/environments.
    tool_mask: list[int] | None = None
    # Extra per-rollout fields handed to reward functions as columns (e.g. from an agent loop).
    extra: dict[str, Any] = field(default_factory=dict)
    # Extra model inputs of the prompt (images: ``pixel_values``, ``image_grid_thw``, ...): a
    # one-row :class:`RowInputs`; every completion of a prompt carries its own.
    model_inputs: "RowInputs | None" = None
    # The prompt's images (PIL), for the completion table's ``image`` column.
    images: list[Any] | None = None


@dataclass
class RolloutBatch:
    """A training micro-batch: padded tensors plus the bookkeeping the loss needs.

    Built by the data side, consumed by ``GRPOModule.training_step``. Tensors are on the
    training device.
    """

    prompt_ids: torch.Tensor  # (B, Tp) left-padded
    prompt_mask: torch.Tensor  # (B, Tp) 1 = real token
    completion_ids: torch.Tensor  # (B, T) right-padded
    completion_mask: torch.Tensor  # (B, T) 1 = real token (zeroed rows for masked truncations)
    advantages: torch.Tensor  # (B,)
    # Global count of loss tokens per optimizer step (all ranks): the dapo/cispo/vespo normaliser.
    num_items_in_batch: torch.Tensor  # () float
    policy_versions: torch.Tensor  # (B,) long: optimizer step that generated each row
    temperature: float = 1.0
    max_completion_length: int = 512
    tool_mask: torch.Tensor | None = None  # (B, T) 1 = policy token
    old_logps: torch.Tensor | None = None  # (B, T) log-probs at generation time, when needed
    ref_logps: torch.Tensor | None = None  # (B, T) reference-model log-probs when beta != 0
    sampling_logps: torch.Tensor | None = None  # (B, T) sampler-reported log-probs
    sampling_is_weights: torch.Tensor | None = None  # (B, T) or (B, 1) sampler IS correction
    # Generation-side metrics, present on the first micro-batch of each generation batch only,
    # so that they are averaged once per generation batch (TRL semantics).
    generation_metrics: dict[str, float] = field(default_factory=dict)
    # Seconds spent preparing this micro-batch (generation, rewards, old/ref log-probs).
    prepare_seconds: float = 0.0
    # Which generation batch / micro-batch / replay this is (for logging and tests).
    generation_index: int = 0
    micro_index: int = 0
    iteration: int = 0
    # Prefix of every metric of this batch: "" in training, "eval_" (or "eval_<set>_") in evaluation.
    metric_prefix: str = ""
    # Micro-steps in this batch's optimizer step: ``accumulate_grad_batches``, or fewer for the
    # short last window of an epoch (Lightning steps the optimizer at the epoch's end). None: the
    # trainer's ``accumulate_grad_batches``.
    accumulation_steps: int | None = None
    # Per-row extra model inputs (images) that every forward of these rows takes; None: text only.
    model_inputs: "RowInputs | None" = None
    # (B,) bool, evaluation: False for rows that repeat a prompt only to keep ranks in step (they
    # count in no metric; ``eval_loss`` weighs a step by its counted rows). None: every row counts.
    counted: torch.Tensor | None = None

    @property
    def loss_mask(self) -> torch.Tensor:
        """``completion_mask * tool_mask``: the tokens the loss and the token counts use. (B, T)"""
        if self.tool_mask is None:
            return self.completion_mask
        return self.completion_mask * self.tool_mask

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def counted_rows(self) -> int:
        """The rows that count in metrics (all but the evaluation repeats of ``counted``)."""
        return len(self) if self.counted is None else int(self.counted.sum())

    def to(self, device: torch.device | str) -> "RolloutBatch":
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        if self.model_inputs is not None:
            moved["model_inputs"] = self.model_inputs.to(device)
        return replace(self, **moved)

    def select_rows(self, rows: torch.Tensor) -> "RolloutBatch":
        """The rows ``rows`` (index tensor) of every per-row tensor, with the padding trimmed to
        the longest kept prompt (left) and completion (right)."""
        picked = {name: getattr(self, name)[rows] for name in _ROW_TENSORS if getattr(self, name) is not None}
        prompt_width = int(picked["prompt_mask"].sum(1).max()) if len(rows) else 0
        completion_width = max(int(picked["completion_mask"].sum(1).max()) if len(rows) else 0, 1)
        if self.model_inputs is not None and self.model_inputs.completion_rows and len(rows):
            # image tokens in a completion (agent tool turns) stay even in a row whose mask is zeroed
            lengths = next(iter(self.model_inputs.select(rows.tolist()).completion_rows.values()))
            completion_width = max(completion_width, *(int(v.shape[0]) for v in lengths))
        for name in ("prompt_ids", "prompt_mask"):
            picked[name] = picked[name][:, picked[name].shape[1] - prompt_width :]
        for name in _COMPLETION_WIDTH_TENSORS:
            if name in picked:
                picked[name] = picked[name][:, :completion_width]
        if self.model_inputs is not None:
            picked["model_inputs"] = self.model_inputs.select(rows.tolist())
        weights = picked.get("sampling_is_weights")
        if weights is not None and weights.shape[1] > 1:
            picked["sampling_is_weights"] = weights[:, :completion_width]
        return replace(self, **picked)


# Per-row tensors of a RolloutBatch, and those of them that span the completion width.
_ROW_TENSORS = (
    "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages", "policy_versions",
    "tool_mask", "old_logps", "ref_logps", "sampling_logps", "sampling_is_weights", "counted",
)  # fmt: skip
_COMPLETION_WIDTH_TENSORS = ("completion_ids", "completion_mask", "tool_mask", "old_logps", "ref_logps", "sampling_logps")


@dataclass
class RowInputs:
    """Extra model inputs of a batch's rows (images), kept per row so that they follow the rows
    through shuffling, micro-batch splitting, replay and token-budget groups.

    ``rows[name][i]`` is row ``i``'s value of the processor output ``name`` for its prompt alone:
    flattened fields as the processor gives them for one prompt (Qwen-VL's ``pixel_values``
    ``(patches_i, D)`` and ``image_grid_thw`` ``(images_i, 3)``), batch-first fields with their
    batch dim of 1 (Idefics3's ``pixel_values`` ``(1, images_i, 3, H, W)``), and the fields aligned
    with the prompt tokens (``token_fields``, e.g. ``mm_token_type_ids``) as ``(Lp_i,)``.
    ``completion_rows[name][i]`` (token fields only, optional) is row ``i``'s value over its first
    ``C_i`` completion tokens (an agent's tool turn rendered with images puts image tokens there);
    absent: zeros.
    """

    rows: dict[str, list[torch.Tensor]]
    token_fields: tuple[str, ...] = ()
    completion_rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(next(iter(self.rows.values()), []))

    def select(self, rows: Sequence[int]) -> "RowInputs":
        return RowInputs({k: [v[i] for i in rows] for k, v in self.rows.items()}, self.token_fields,
                         {k: [v[i] for i in rows] for k, v in self.completion_rows.items()})

    def to(self, device: torch.device | str) -> "RowInputs":
        return RowInputs({k: [t.to(device) for t in v] for k, v in self.rows.items()}, self.token_fields,
                         {k: [t.to(device) for t in v] for k, v in self.completion_rows.items()})

    def collate(self, prompt_width: int, completion_width: int = 0) -> dict[str, torch.Tensor]:
        """The model's keyword arguments for all rows: token fields left-padded to ``prompt_width``
        and extended by ``completion_width`` zeros ``(B, Tp+T)``; the others concatenated along
        dim 0, trailing dims zero-padded to the largest row (Idefics3: absent images are zeros)."""
        out: dict[str, torch.Tensor] = {}
        for name, values in self.rows.items():
            if name in self.token_fields:
                padded = values[0].new_zeros((len(values), prompt_width + completion_width))
                for i, v in enumerate(values):
                    padded[i, prompt_width - v.shape[0] : prompt_width] = v
                for i, v in enumerate(self.completion_rows.get(name, [])[: len(values)]):
                    n = min(v.shape[0], completion_width)  # (C_i,) over the completion's first tokens
                    padded[i, prompt_width : prompt_width + n] = v[:n]
                out[name] = padded
                continue
            shape = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
            parts = []
            for v in values:
                if list(v.shape[1:]) != shape:
                    grown = v.new_zeros((v.shape[0], *shape))
                    grown[(slice(None), *(slice(0, n) for n in v.shape[1:]))] = v
                    v = grown
                parts.append(v)
            out[name] = torch.cat(parts)
        return out


@dataclass
class CompletionTable:
    """The completions of one generation batch, all ranks, for completion logging.

    ``columns`` maps a column name to one value per completion: ``prompt``, ``completion``,
    ``advantage``, one ``reward/<name>`` per reward function, and every ``log_extra`` column.
    """

    step: int
    columns: dict[str, list[Any]]

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()), []))


@dataclass(frozen=True)
class TrainerState:
    """Training progress, passed to reward functions as ``trainer_state``.

    Reward functions written for TRL read HF's ``TrainerState`` (for curricula or reward shaping by
    progress); these are the attributes they use, with the same meaning. A fresh one is built for
    every generation batch (training and evaluation).

    Attributes:
        global_step: Optimizer steps taken so far (``trainer.global_step``).
        epoch: Epochs done as a float, like HF's ``state.epoch``: completed epochs plus the
            fraction of the current one (micro-steps trained / micro-steps per epoch).
        max_steps: Optimizer steps planned for the run: ``trainer.max_steps``, or, when that is -1,
            Lightning's ``estimated_stepping_batches`` (from ``max_epochs``); ``math.inf`` when the
            run is unbounded. In a run without training (``grpo validate``): ``trainer.max_steps``,
            or ``math.inf`` when it is -1.
        num_train_epochs: Epochs planned: enough epochs to take ``max_steps`` optimizer steps
            (HF's rule), else ``trainer.max_epochs``; ``math.inf`` when unbounded.
        is_world_process_zero: True on the global rank-0 process (log from one process only).
        trainer: The Lightning ``Trainer`` itself, for anything else (``current_epoch``,
            ``callback_metrics``, ``loggers``, ...).
    """

    global_step: int
    epoch: float
    max_steps: int | float
    num_train_epochs: int | float
    is_world_process_zero: bool
    trainer: Any = field(default=None, repr=False, compare=False)


@runtime_checkable
class PolicyHandle(Protocol):
    """What the data side and samplers may use of the live policy (the module implements it).

    The data side reaches it as ``trainer.lightning_module``; it never imports the module.
    """

    @property
    def policy(self) -> torch.nn.Module:
        """The live (unwrapped) policy model, for generation."""

    @property
    def tokenizer(self) -> Any:
        """The policy's tokenizer (a ``PreTrainedTokenizerBase``)."""

    @property
    def device(self) -> torch.device: ...

    @property
    def policy_version(self) -> int:
        """Optimizer steps taken so far: stamped on every rollout."""

    def rollout_logprobs(
        self, batch: RolloutBatch, *, reference: bool, chunk_size: int
    ) -> torch.Tensor:
        """No-grad per-token log-probs of ``batch`` completions, ``(B, T)``, under the current
        policy (``reference=False``, the "old" log-probs) or the frozen reference model."""

    @property
    def needs_reference_logprobs(self) -> bool:
        """True when the loss has a KL term (beta != 0)."""

    def precision_context(self) -> ContextManager[None]:
        """The training forward's precision context (autocast under mixed precision).

        Generation and the no-grad log-prob passes run under it, so they see the same policy
        (the same numerics) as the training step: otherwise a bf16-trained policy would be
        sampled in fp32 and the ratio of a replayed batch would not start at 1."""

    def generation_context(self) -> ContextManager[None]:
        """Whole weights for the duration of the block: gathers sharded parameters (FSDP2
        unshard, DeepSpeed ZeRO-3 ``GatheredParameters``) so ``policy`` can generate or be copied
        into an inference engine; a no-op when the weights are not sharded."""

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every id that ends a completion: the tokenizer's EOS plus the model's generation-config
        EOS ids (chat models such as Gemma-it end a turn with another id)."""


def missing_handle_members(obj: Any) -> list[str]:
    """Members of :class:`PolicyHandle` that ``obj`` lacks (empty when it is a valid handle).

    ``isinstance(obj, PolicyHandle)`` is not used: from Python 3.12 it looks attributes up
    statically and so misses ``nn.Module`` submodules; ``hasattr`` is not used either, since it
    evaluates properties (``policy`` exists only once the models are built).
    """
    names = (
        "policy", "tokenizer", "device", "policy_version", "rollout_logprobs", "needs_reference_logprobs",
        "precision_context", "generation_context", "eos_token_ids",
    )
    return [name for name in names if not _declares(obj, name)]


def _declares(obj: Any, name: str) -> bool:
    """Whether ``obj`` has ``name`` without evaluating it (a property may need built models)."""
    if any(name in vars(cls) for cls in type(obj).__mro__):
        return True
    return name in getattr(obj, "__dict__", {}) or name in getattr(obj, "_modules", {})


PromptInput = Sequence[int]
"""A tokenized prompt: the sampler receives ids, never text."""
