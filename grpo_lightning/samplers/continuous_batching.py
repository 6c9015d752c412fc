"""Continuous batching: transformers' paged-attention engine (``generate_batch``'s manager) on the
live policy, in-process, with the sampler's per-token log-probs (TRL's
``use_transformers_continuous_batching``, spec §8.2, without its in-place bf16 cast)."""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterator, Sequence

import torch

from grpo_lightning.samplers.base import Sampler
from grpo_lightning.samplers.generation_checks import check_hf_generation
from grpo_lightning.samplers.hf_common import build_generation_config, completion_rollout, generation_mode
from grpo_lightning.types import GenerationParams, PolicyHandle, PromptInput, Rollout
from grpo_lightning.utils.module_modes import eval_mode

CPU_PAGE_SIZE = 64  # tokens per cache page on CPU (transformers' 256 suits GPU kernels; short rows waste less)
MAX_DEFAULT_BATCH_TOKENS = 4096  # cap of the default tokens per engine step
SIZED_SETTINGS = ("num_blocks", "max_batch_tokens")  # a larger kept cache serves a smaller request
MIN_TRANSFORMERS = "5.18"  # tested on 5.18, 5.23 and 5.24


@dataclass(frozen=True)
class ManagerPlan:
    """What a continuous-batching manager was built for: its sampling settings (the manager bakes
    them into its logits processors) and its engine settings."""

    generation: str  # the GenerationConfig as JSON
    settings: tuple[tuple[str, Any], ...]  # ContinuousBatchingConfig keyword arguments, sorted

    def serves(self, needed: ManagerPlan) -> bool:
        """Same sampling and engine settings, with a cache and step at least as large as ``needed``'s."""
        mine, theirs = dict(self.settings), dict(needed.settings)
        if self.generation != needed.generation or mine.keys() != theirs.keys():
            return False
        return all(
            mine[k] == theirs[k] or (k in SIZED_SETTINGS and None not in (mine[k], theirs[k]) and mine[k] >= theirs[k])
            for k in mine
        )


class ContinuousBatchingSampler(Sampler):
    """Samples with transformers' continuous batching (paged KV cache, requests scheduled in and out
    of one running batch) on the policy being trained, and reports each sampled token's log-prob.

    Same sampling as ``hf_generate``: one ``GenerationConfig`` from ``data.generation`` (temperature,
    top_p/top_k/min_p, ``generation_kwargs``), stopping on every EOS id of the policy, completions cut
    after the first of them. Logits processors that continuous batching cannot apply
    (``repetition_penalty != 1``, ...) raise instead of being dropped silently. Vision-language
    models (a processor as tokenizer, a ``vision_config``) are refused, as in TRL.

    **Log-probs** (``Rollout.sampling_logprobs``): ``log softmax`` of the *processed* logits, in
    float32: the logits divided by the temperature, then top-k/top-p/min-p truncated and
    renormalised. Without truncation (TRL's defaults ``top_k=0, top_p=1, min_p=None``) they are the
    trainer's log-probs ``log_softmax(logits / T)`` up to float32 rounding and the engine's
    attention kernel; with truncation they are higher, and the importance-sampling correction
    (``data.importance_sampling``, on by default for samplers with log-probs) accounts for the gap.

    **Precision.** The parameters are never cast (TRL casts the trained model to bf16 in place,
    spec §14.11): the forward runs under the training precision context (``bf16-mixed`` autocast)
    on the engine's own thread, keys/values are stored in the cache in the parameters' dtype
    (exact), gradient checkpointing is paused, the model is in eval mode while generating, and
    every module's training flag is restored afterwards. Weights are gathered under sharding
    (``handle.generation_context()``).

    **Cache.** With ``keep_cache`` the engine (its paged cache) is built once and reused by later
    calls; its prefix cache is cleared at every call, because cached blocks hold keys/values
    computed by older weights. It is rebuilt when the sampling settings change or a request needs
    more room than the default sizes gave it. Unless ``continuous_batching_config`` sets them (or
    sets ``max_memory_percent``: transformers then sizes the cache from free memory), the sizes
    come from the request, on every device: ``num_blocks`` holds every row at once,
    ``rows x ceil((longest prompt + max_completion_length) / page_size)`` rounded up to a power
    of two (the memory ``generate``'s own cache would take); ``max_batch_tokens`` is the prompt
    tokens of the request (at least one per row) rounded up to a power of two, at most 4096;
    ``page_size`` is 64 on CPU. transformers' own default sizes the cache from free memory
    (14 GB of RAM on CPU; on GPU half the free memory with TRL's ``max_memory_percent=0.5``, held
    through the optimizer step when the cache is kept).

    **Randomness.** Each call draws one seed from the global generator and samples from a fork
    seeded with it; requests are queued before the engine starts, so a seed gives the same
    completions and the engine's own reseeding never shifts the training process's RNG stream.

    Args:
        continuous_batching_config: Keyword arguments of ``transformers.ContinuousBatchingConfig``
            (TRL's ``transformers_continuous_batching_config``), e.g. ``{num_blocks: 256,
            page_size: 64, max_batch_tokens: 2048}`` or ``{max_memory_percent: 0.5}``;
            ``return_logprobs`` is always on. Unset sizes are derived from each request (above).
        keep_cache: Keep the engine and its paged cache between calls (``persistent_manager``);
            ``False`` builds and frees it at every generation batch, returning its memory to
            training between them.
    """

    name = "continuous_batching"
    provides_logprobs = True

    def __init__(self, continuous_batching_config: dict[str, Any] | None = None, keep_cache: bool = True):
        super().__init__()
        settings = dict(continuous_batching_config or {})
        if settings.get("return_logprobs", True) is not True:
            raise ValueError(
                "continuous_batching_config.return_logprobs: the sampler reports log-probs, it is always on; "
                "remove the key (use data.importance_sampling.enabled: false to ignore them)."
            )
        self.continuous_batching_config = settings
        self.keep_cache = keep_cache
        self._manager: Any = None
        self._plan: ManagerPlan | None = None

    def check_generation(self, params: GenerationParams) -> None:
        check_hf_generation(params, "data.sampler: continuous_batching")

    def bind(self, handle: PolicyHandle) -> None:
        check_engine_version()
        self._drop_manager()  # a manager belongs to one model
        super().bind(handle)

    def engine_settings(self, rows: Sequence[Sequence[int]], params: GenerationParams) -> dict[str, Any]:
        """The ``ContinuousBatchingConfig`` keyword arguments for a request of ``rows`` prompts: the
        user's, plus sizes derived from the request where the user set none (class docstring)."""
        from transformers import ContinuousBatchingConfig

        settings = {**self.continuous_batching_config, "return_logprobs": True}
        if settings.get("max_memory_percent") is not None:
            return settings  # sized from free memory, as asked
        if self.handle.device.type == "cpu" and "page_size" not in settings and "block_size" not in settings:
            settings["page_size"] = CPU_PAGE_SIZE
        page = settings.get("block_size") or settings.get("page_size") or ContinuousBatchingConfig.page_size
        row_tokens = max(len(r) for r in rows) + params.max_completion_length
        settings.setdefault("num_blocks", _next_pow2(len(rows) * math.ceil(row_tokens / page)))
        prompt_tokens = max(sum(len(r) for r in rows), len(rows))
        settings.setdefault("max_batch_tokens", min(MAX_DEFAULT_BATCH_TOKENS, _next_pow2(prompt_tokens)))
        return settings

    def generate(
        self, prompts: Sequence[PromptInput], num_generations: int, params: GenerationParams
    ) -> list[Rollout]:
        handle = self.handle
        model = handle.policy
        _refuse_multimodal(handle)
        rows = [list(p) for p in prompts for _ in range(num_generations)]  # prompt-major
        if not rows:
            return []
        generation = build_generation_config(handle, params)
        settings = self.engine_settings(rows, params)
        with handle.generation_context(), generation_mode(model), eval_mode(model), \
                _forward_under(model, handle.precision_context), _forked_rng(handle.device) as seed:
            outputs = self._run(model, rows, generation, settings, params.max_completion_length, seed)
        stop, version = set(handle.eos_token_ids), handle.policy_version
        return [completion_rollout(row, out.generated_tokens, stop, version, out.logprobs) for row, out in zip(rows, outputs)]

    def _run(
        self, model: Any, rows: list[list[int]], generation: Any, settings: dict[str, Any], max_new_tokens: int, seed: int
    ) -> list[Any]:
        """The engine's outputs (``GenerationOutput``) for ``rows``, in their order, sampled from ``seed``."""
        manager = self._manager_for(model, generation, settings)
        started = ok = False
        try:
            flash = getattr(manager.continuous_batching_config, "auto_switch_to_flash", None)  # transformers >= 5.19
            manager.switch_to_cb_friendly_attn(model, *(() if flash is None else (flash,)))
            if manager.batch_processor is None:
                manager.warmup()  # builds the paged cache (and captures CUDA graphs when enabled)
            cache = manager.batch_processor.cache
            cache.reset()  # forget cached prefix blocks: their keys/values came from older weights
            _store_kv_in_cache_dtype(cache)
            # Queue every request before the loop starts, so batches (and random draws) never
            # depend on thread timing. clear() is the pre-start reset start() itself performs.
            manager.background_thread_status.clear()
            request_ids = manager.add_requests(rows, max_new_tokens=max_new_tokens)
            torch.manual_seed(seed)  # after the engine reseeded the generator (when it built its processor)
            manager.start()
            started = True
            results = _collect(manager, request_ids)
            outputs = [results.get(i) for i in request_ids]
            failed = [o.error for o in outputs if o is not None and o.error is not None]
            if None in outputs or failed:
                fatal = manager.background_thread_status.fatal_error
                raise RuntimeError(
                    f"ContinuousBatchingSampler: {sum(o is None for o in outputs)} of {len(rows)} requests missing and "
                    f"{len(failed)} failed in transformers' continuous batching: {fatal or (failed or ['?'])[0]}"
                )
            ok = True
        finally:
            keep = ok and self.keep_cache  # a manager that failed is not reused
            if started:  # stop() also restores the attention implementation; a failed call does not wait
                manager.stop(block=True, keep_for_next_session=keep, hard_stop=not ok)
            elif getattr(manager, "_original_attn_impl", None) is not None:
                model.set_attn_implementation(manager._original_attn_impl)
                manager._original_attn_impl = None
            model.__dict__.pop("_cached_continuous_batching_manager", None)  # ours to keep, not the model's
            if not keep:
                self._drop_manager()
        for output in outputs:
            if len(output.logprobs) != len(output.generated_tokens):
                raise RuntimeError(f"continuous batching returned {len(output.logprobs)} log-probs for "
                                   f"{len(output.generated_tokens)} tokens.")
        return outputs

    def _manager_for(self, model: Any, generation: Any, settings: dict[str, Any]) -> Any:
        """The kept manager when it serves this request, else a new one."""
        from transformers import ContinuousBatchingConfig

        plan = ManagerPlan(generation.to_json_string(), tuple(sorted(settings.items())))
        manager = self._manager
        if manager is not None and (manager.model is not model or manager.is_running() or not self._plan.serves(plan)):
            self._drop_manager()
        if self._manager is None:
            _refuse_unsupported_processors(model, generation)
            model.destroy_cached_continuous_batching_manager()  # else init would return it, sized for other work
            self._manager = model.init_continuous_batching(
                generation_config=generation, continuous_batching_config=ContinuousBatchingConfig(**settings)
            )
            self._plan = plan
        return self._manager

    @property
    def engine_config(self) -> Any:
        """The kept manager's resolved ``ContinuousBatchingConfig`` (``None`` when none is kept)."""
        return None if self._manager is None else self._manager.continuous_batching_config

    def _drop_manager(self) -> None:
        manager, self._manager, self._plan = self._manager, None, None
        if manager is not None:
            manager.destroy()
            manager.batch_processor = None  # frees the paged cache now

    def close(self) -> None:
        """Free the engine and its paged cache."""
        self._drop_manager()


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def _collect(manager: Any, request_ids: list[str]) -> dict[str, Any]:
    """Finished outputs by request id, until all arrived or the engine's thread ended."""
    pending, done = set(request_ids), {}
    while pending:
        output = manager.get_result(timeout=1)
        if output is None:
            if not manager.is_running():
                break
            continue
        if output.is_finished() and output.request_id in pending:
            pending.discard(output.request_id)
            done[output.request_id] = output
    return done


def check_engine_version() -> None:
    """The engine this sampler drives appeared in its current form in transformers 5.18 (``page_size``,
    and a paged cache that can forget its prefix blocks after a weight push); refuse older ones."""
    import transformers
    from transformers import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    if not (hasattr(ContinuousBatchingConfig, "page_size") and hasattr(PagedAttentionCache, "reset")):
        raise RuntimeError(
            f"data.sampler: continuous_batching needs transformers >= {MIN_TRANSFORMERS} (its paged cache must forget "
            f"prefix blocks computed with older weights); this is transformers {transformers.__version__}. "
            f"pip install -U 'transformers>={MIN_TRANSFORMERS}', or use data.sampler: hf_generate or fast_generate."
        )


def _refuse_multimodal(handle: PolicyHandle) -> None:
    if hasattr(handle.tokenizer, "image_processor") or getattr(getattr(handle.policy, "config", None), "vision_config", None):
        raise ValueError(
            "ContinuousBatchingSampler: transformers' continuous batching takes token ids only and cannot feed "
            "images to a vision-language model (TRL refuses this combination too). Use data.sampler: hf_generate."
        )


def _refuse_unsupported_processors(model: Any, generation: Any) -> None:
    """Continuous batching drops logits processors it does not support (with a log warning only):
    sampling would silently differ from ``data.generation``."""
    processors = model._get_logits_processor(generation)
    unsupported = [type(p).__name__ for p in processors if getattr(p, "supports_continuous_batching", None) is False]
    if unsupported:
        raise ValueError(
            f"data.generation asks for {unsupported}, which transformers' continuous batching cannot apply (e.g. "
            "repetition_penalty != 1.0, min_new_tokens). Drop the setting or use data.sampler: hf_generate."
        )


def _store_kv_in_cache_dtype(cache: Any) -> None:
    """Under autocast the projections give bfloat16 values but the paged cache has the parameters'
    dtype, and its ``index_copy_`` refuses mixed dtypes. Storing them in the cache dtype is exact
    (bfloat16 values are float32 values); attention casts them back under autocast, as the
    training forward does."""
    if getattr(cache, "_stores_in_cache_dtype", False):
        return
    update = cache.update

    def update_in_cache_dtype(key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return update(key_states.to(cache.dtype), value_states.to(cache.dtype), *args, **kwargs)

    cache.update = update_in_cache_dtype
    cache._stores_in_cache_dtype = True


@contextmanager
def _forward_under(model: torch.nn.Module, context: Callable[[], ContextManager[Any]]) -> Iterator[None]:
    """Every call of ``model``'s forward runs inside ``context()``: the engine calls it on its own
    thread, which the caller's autocast (thread-local) does not reach."""
    previous = model.__dict__.get("forward")
    inner = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with context():
            return inner(*args, **kwargs)

    model.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del model.forward
        else:
            model.forward = previous


@contextmanager
def _forked_rng(device: torch.device) -> Iterator[int]:
    """A fork of the global generator, and a seed drawn from it to sample with: the engine reseeds
    the global generator when it builds its batch processor, which must not shift the training RNG."""
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    with torch.random.fork_rng(devices=[device.index or 0] if device.type == "cuda" else []):
        yield seed
