"""A user's own generation function as a sampler: TRL's ``rollout_func``.

Layer L2. The function gets each prompt once and returns ``num_generations`` completions for each
(TRL: "the raw per-process prompt slice with no duplication"), as a dict of per-completion lists:

    rollout_func(prompts, ctx) -> {"prompt_ids": ..., "completion_ids": ..., "logprobs": ..., **extra}

Its output is checked here before anything is trained on it; each error names the field, the row
and what was expected.
"""

from __future__ import annotations

import math
import numbers
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Mapping, Sequence

import torch

from grpo_lightning.rewards.loading import callable_name, import_dotted_path
from grpo_lightning.rewards.runner import EXCLUDED_COLUMNS, RESERVED_KWARGS
from grpo_lightning.samplers.base import Sampler
from grpo_lightning.samplers.hf_common import generation_mode
from grpo_lightning.types import GenerationParams, PolicyHandle, PromptInput, Rollout
from grpo_lightning.utils.weight_casts import reused_weight_casts

REQUIRED_KEYS = ("prompt_ids", "completion_ids", "logprobs")
#: Keys with a meaning of their own (TRL): ``env_mask`` becomes the tool mask (1 = policy token,
#: 0 = inserted by an environment); ``logprob_token_ids`` is checked like ``logprobs`` and, as in
#: TRL, reaches the reward functions as a column.
MASK_KEY, LOGPROB_IDS_KEY = "env_mask", "logprob_token_ids"


@dataclass(frozen=True)
class RolloutContext:
    """The second argument of a rollout function (TRL passes the trainer).

    Attributes:
        handle: The live policy (:class:`~grpo_lightning.types.PolicyHandle`).
        num_generations: Completions to return per prompt (``data.num_generations``, or
            ``data.num_generations_eval`` in evaluation; 1 when a group is split between ranks).
        params: The sampling settings (``data.generation``: ``max_completion_length``,
            ``temperature``, ``top_p``, ...).
    """

    handle: PolicyHandle
    num_generations: int
    params: GenerationParams

    @property
    def policy(self) -> torch.nn.Module:
        """The policy being trained (sample from it inside :meth:`generating`)."""
        return self.handle.policy

    @property
    def tokenizer(self) -> Any:
        return self.handle.tokenizer

    @property
    def device(self) -> torch.device:
        return self.handle.device

    @property
    def policy_version(self) -> int:
        """Optimizer steps taken so far: the version stamped on the returned completions."""
        return self.handle.policy_version

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.handle.eos_token_ids

    def generation_context(self) -> ContextManager[None]:
        """Whole (gathered) weights for the block under a sharding strategy; a no-op otherwise."""
        return self.handle.generation_context()

    def precision_context(self) -> ContextManager[None]:
        """The training forward's precision (autocast under mixed precision)."""
        return self.handle.precision_context()

    @contextmanager
    def generating(self) -> Iterator[None]:
        """Everything that sampling from ``policy`` needs, as the built-in samplers do it: whole
        weights, the training precision, ``torch.no_grad``, the KV cache on and gradient
        checkpointing off. Under ``*-mixed`` precision each trainable weight is cast to 16 bits once
        for the block, not at every forward (autocast's weight-cast cache, emptied on exit)."""
        with ExitStack() as stack:
            stack.enter_context(self.generation_context())
            stack.enter_context(generation_mode(self.policy))
            stack.enter_context(self.precision_context())
            stack.enter_context(reused_weight_casts(self.device))
            yield


class RolloutFuncSampler(Sampler):
    """Generation by a function of your own (TRL's ``rollout_func``): a custom decoding loop, a
    multi-turn environment, a remote engine.

    The function is called once per generation batch as ``rollout_func(prompts, ctx)``:

    * ``prompts``: the token ids of each prompt of the batch, once each (chat template already
      applied as configured in ``data``; TRL passes the prompts untokenized, see docs/samplers.md);
    * ``ctx``: a :class:`RolloutContext` (``policy``, ``tokenizer``, ``device``,
      ``policy_version``, ``num_generations``, ``params``, ``generating()``).

    It returns a dict of lists with one entry per completion, ``len(prompts) * num_generations``
    entries, prompt-major (the completions of prompt 0 first):

    * ``prompt_ids``: the prompt ids of each completion (by default they must be the ids given);
    * ``completion_ids``: the generated ids, at least one each; these are the ids trained on. A
      completion counts as finished when its last id is an EOS id (``ctx.eos_token_ids``) or the
      pad id, else as cut by the length limit (TRL's rule);
    * ``logprobs``: the sampler's log-prob of each completion token, or ``None`` (then set
      ``provides_logprobs: false``; the key may then be left out);
    * optional ``env_mask``: per token 1 (generated by the policy) or 0 (inserted by an
      environment or a tool: excluded from the loss, attended to);
    * optional ``logprob_token_ids``: like ``logprobs``, one entry per completion token;
    * any other key: passed to the reward functions as a column of that name. A list gives one
      value per completion; any other value is given to every completion (TRL).

    The function samples from the live policy (``ctx.policy`` inside ``ctx.generating()``), or
    keeps its own engine up to date itself: the completions are stamped with
    ``ctx.policy_version``.

    Args:
        rollout_func: The function, or its dotted path (``mypkg.rollouts.generate``).
        provides_logprobs: The function returns ``logprobs``: they become the rollouts' sampler
            log-probs, so the importance-sampling correction (``data.importance_sampling``) and
            ``off_policy_mask_threshold`` use them. ``false``: ``logprobs`` must be ``None`` or
            absent.
        rollout_fields: Names of the extra fields the function returns, so that reward
            functions that take them as arguments pass the signature check made before training;
            each listed field must then be returned.
        check_prompt_ids: Require each returned ``prompt_ids`` row to be the ids of its prompt.
            Set ``false`` when the function edits prompts on purpose (e.g. an environment adds an
            observation): the returned ids are then the context trained on.
    """

    name = "rollout_func"

    def __init__(
        self,
        rollout_func: str | Callable[..., Mapping[str, Any]] | None = None,
        provides_logprobs: bool = True,
        rollout_fields: list[str] | None = None,
        check_prompt_ids: bool = True,
    ) -> None:
        super().__init__()
        if rollout_func is None:
            raise ValueError(
                "RolloutFuncSampler needs rollout_func: give it in YAML as data.sampler: {class_path: "
                "grpo_lightning.samplers.rollout_func.RolloutFuncSampler, init_args: {rollout_func: "
                "mypkg.module.function}}."
            )
        func = import_dotted_path(rollout_func) if isinstance(rollout_func, str) else rollout_func
        if not callable(func):
            raise ValueError(f"rollout_func={rollout_func!r} is not callable: give a function or its dotted path.")
        fields = tuple(rollout_fields or ())
        bad = [n for n in fields if n in _RESERVED or n in (MASK_KEY, *REQUIRED_KEYS)]
        if bad:
            raise ValueError(f"rollout_fields={list(fields)}: {bad} cannot be extra fields ({_reserved_hint()}).")
        self.rollout_func = func
        self.func_name = _qualified_name(func)
        # Instance attributes override the Sampler class defaults: the datamodule reads them.
        self.provides_logprobs = provides_logprobs  # type: ignore[misc]
        self.rollout_fields = fields  # type: ignore[misc]
        self.check_prompt_ids = check_prompt_ids

    def generate(
        self, prompts: Sequence[PromptInput], num_generations: int, params: GenerationParams
    ) -> list[Rollout]:
        given = [list(p) for p in prompts]
        ctx = RolloutContext(self.handle, num_generations, params)
        output = self.rollout_func(given, ctx)
        return self.to_rollouts(output, given, num_generations)

    def to_rollouts(self, output: Any, prompts: list[list[int]], num_generations: int) -> list[Rollout]:
        """The checked ``output`` of the function as ``len(prompts) * num_generations`` rollouts."""
        where = f"rollout_func {self.func_name}"
        if not isinstance(output, Mapping):
            raise ValueError(f"{where} returned a {type(output).__name__}; it must return a dict with the keys "
                             f"{', '.join(REQUIRED_KEYS)} (one list entry per completion).")
        required = REQUIRED_KEYS if self.provides_logprobs else REQUIRED_KEYS[:2]
        missing = [k for k in required if k not in output]
        if missing:
            hint = " (or set provides_logprobs: false if it has none)" if "logprobs" in missing else ""
            raise ValueError(f"{where} returned no {missing}{hint}; it returned the keys {sorted(output)}.")
        n = len(prompts) * num_generations
        rows = _Rows(where, n, len(prompts), num_generations)
        completion_ids = [rows.ints("completion_ids", i, ids) for i, ids in enumerate(rows.column(output, "completion_ids"))]
        for i, ids in enumerate(completion_ids):
            if not ids:
                raise ValueError(f"{where}: completion_ids[{i}] is empty; every completion needs at least one token "
                                 "(end it with the EOS id).")
        prompt_ids = [rows.ints("prompt_ids", i, ids) for i, ids in enumerate(rows.column(output, "prompt_ids"))]
        if self.check_prompt_ids:
            _check_prompts(where, prompt_ids, prompts, num_generations)
        logprobs = self._logprobs(output.get("logprobs"), rows, completion_ids)
        tool_mask = self._env_mask(output.get(MASK_KEY), rows, completion_ids)
        extra = self._extra(output, rows, completion_ids)
        tokenizer, version = self.handle.tokenizer, self.handle.policy_version
        finished = {*self.handle.eos_token_ids, *([tokenizer.pad_token_id] if tokenizer.pad_token_id is not None else [])}
        return [
            Rollout(
                prompt_ids[i], completion_ids[i], ended_on_eos=completion_ids[i][-1] in finished,
                policy_version=version, sampling_logprobs=None if logprobs is None else logprobs[i],
                tool_mask=None if tool_mask is None else tool_mask[i],
                extra={name: values[i] for name, values in extra.items()},
            )
            for i in range(n)
        ]

    def _logprobs(self, value: Any, rows: "_Rows", completion_ids: list[list[int]]) -> list[list[float]] | None:
        where = rows.where
        if value is None:
            if self.provides_logprobs:
                raise ValueError(f"{where} returned logprobs=None; return each completion token's log-prob, or set "
                                 "provides_logprobs: false on the sampler.")
            return None
        if not self.provides_logprobs:
            raise ValueError(f"{where} returned logprobs but the sampler has provides_logprobs: false; set it true "
                             "to use them (importance-sampling correction), or return logprobs=None.")
        column = rows.column({"logprobs": value}, "logprobs")
        return [rows.floats("logprobs", i, lp, len(completion_ids[i])) for i, lp in enumerate(column)]

    @staticmethod
    def _env_mask(value: Any, rows: "_Rows", completion_ids: list[list[int]]) -> list[list[int]] | None:
        if value is None:
            return None
        masks = [rows.ints(MASK_KEY, i, m) for i, m in enumerate(rows.column({MASK_KEY: value}, MASK_KEY))]
        for i, mask in enumerate(masks):
            rows.same_length(MASK_KEY, i, len(mask), len(completion_ids[i]))
            if any(v not in (0, 1) for v in mask):
                raise ValueError(f"{rows.where}: {MASK_KEY}[{i}] has values other than 0 and 1 ({sorted(set(mask))}); "
                                 "use 1 for tokens the policy generated and 0 for inserted ones.")
        return masks

    def _extra(self, output: Mapping[str, Any], rows: "_Rows", completion_ids: list[list[int]]) -> dict[str, list[Any]]:
        where = rows.where
        names = [k for k in output if k not in (*REQUIRED_KEYS, MASK_KEY)]
        bad = [k for k in names if not isinstance(k, str) or k in _RESERVED]
        if bad:
            raise ValueError(f"{where} returned the extra fields {bad}, which are not usable as reward columns "
                             f"({_reserved_hint()}); rename them.")
        absent = [k for k in self.rollout_fields if k not in output]
        if absent:
            raise ValueError(f"{where} did not return the fields {absent} listed in rollout_fields; return them "
                             "(one value per completion) or remove them from rollout_fields.")
        extra: dict[str, list[Any]] = {}
        for name in names:
            value = output[name]
            if isinstance(value, list):  # one value per completion (TRL: lists are per row)
                extra[name] = rows.column(output, name)
            else:  # TRL: any other value is given to every completion
                extra[name] = [value] * rows.n
        for i, ids in enumerate(extra.get(LOGPROB_IDS_KEY, [])):
            if not isinstance(ids, (list, tuple)):
                raise ValueError(f"{where}: {LOGPROB_IDS_KEY}[{i}] is a {type(ids).__name__}; expected a list with "
                                 f"one entry per completion token ({len(completion_ids[i])}).")
            rows.same_length(LOGPROB_IDS_KEY, i, len(ids), len(completion_ids[i]))
        return extra


_RESERVED = frozenset(RESERVED_KWARGS) | frozenset(EXCLUDED_COLUMNS)


def _reserved_hint() -> str:
    return f"these names are taken by the reward arguments and the trainer: {', '.join(sorted(_RESERVED))}"


@dataclass(frozen=True)
class _Rows:
    """Checks of per-completion lists; every message names the field, the row and what was expected."""

    where: str
    n: int
    num_prompts: int
    num_generations: int

    def column(self, output: Mapping[str, Any], key: str) -> list[Any]:
        value = _as_list(output[key])
        if not isinstance(value, list):
            raise ValueError(f"{self.where}: '{key}' is a {type(output[key]).__name__}; expected a list with one "
                             f"entry per completion ({self.n}).")
        if len(value) != self.n:
            raise ValueError(
                f"{self.where}: '{key}' has {len(value)} entries for {self.num_prompts} prompts x "
                f"{self.num_generations} generations; expected {self.n}, one per completion, prompt-major. The "
                "function gets each prompt once and returns ctx.num_generations completions for each."
            )
        return value

    def ints(self, key: str, row: int, value: Any) -> list[int]:
        ids = _as_list(value)
        if not isinstance(ids, list):
            raise ValueError(f"{self.where}: {key}[{row}] is a {type(value).__name__}; expected a list of token ids.")
        for position, token in enumerate(ids):
            if not isinstance(token, numbers.Integral) or isinstance(token, bool) or token < 0:
                raise ValueError(f"{self.where}: {key}[{row}][{position}] is {token!r}; expected a token id "
                                 "(a non-negative int).")
        return [int(t) for t in ids]

    def floats(self, key: str, row: int, value: Any, length: int) -> list[float]:
        values = _as_list(value)
        if not isinstance(values, list):
            raise ValueError(f"{self.where}: {key}[{row}] is a {type(value).__name__}; expected a list of "
                             f"{length} floats, one per completion token.")
        self.same_length(key, row, len(values), length)
        for position, x in enumerate(values):
            if not isinstance(x, numbers.Real) or isinstance(x, bool) or not math.isfinite(x):
                raise ValueError(f"{self.where}: {key}[{row}][{position}] is {x!r}; expected a finite float (the "
                                 "log-prob of that completion token).")
        return [float(x) for x in values]

    def same_length(self, key: str, row: int, got: int, expected: int) -> None:
        if got != expected:
            raise ValueError(f"{self.where}: {key}[{row}] has {got} entries but completion_ids[{row}] has {expected} "
                             "tokens; expected one per completion token.")


def _as_list(value: Any) -> Any:
    """Lists as they are; tensors, arrays and tuples as lists; anything else unchanged."""
    if isinstance(value, torch.Tensor) or hasattr(value, "tolist"):  # torch / numpy
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    return value


def _qualified_name(func: Callable[..., Any]) -> str:
    """``module.qualname`` of a function (what a YAML config names), else its display name."""
    module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else callable_name(func)


def _check_prompts(where: str, prompt_ids: list[list[int]], prompts: list[list[int]], num_generations: int) -> None:
    for i, ids in enumerate(prompt_ids):
        given = prompts[i // num_generations]
        if ids != given:
            first = next((p for p, (a, b) in enumerate(zip(ids, given)) if a != b), min(len(ids), len(given)))
            raise ValueError(
                f"{where}: prompt_ids[{i}] is not the ids of its prompt (prompt {i // num_generations}: completions "
                f"are prompt-major, {num_generations} per prompt); they differ from token {first} ({len(ids)} vs "
                f"{len(given)} ids). Return the prompt ids you were given, or set check_prompt_ids: false if the "
                "function changes prompts on purpose."
            )
