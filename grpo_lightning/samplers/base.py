"""The ``Sampler`` interface: how a generation back-end plugs into the data side.

Layer L2. A sampler turns tokenized prompts into :class:`~grpo_lightning.types.Rollout` records.
Token in, token out: the completion ids it returns are the ids trained on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Sequence

from grpo_lightning.samplers.generation_checks import check_generation_kwargs
from grpo_lightning.types import GenerationParams, PolicyHandle, PromptInput, Rollout


class Sampler(ABC):
    """Base class of generation back-ends (HF generate, continuous batching, vLLM, ...).

    Lifecycle:

    1. ``bind(handle)`` once when training starts (the live policy, tokenizer, device, version);
    2. ``on_policy_updated(handle, version)``, the one entry for new weights: a weight-sync
       callback calls it after every optimizer step (and after a resume) for back-ends that keep
       their own copy of the weights (``keeps_own_weights``); it pushes them and records the
       version now served;
    3. ``generate`` for every generation batch; the rollout builder first checks that
       ``served_version`` is the policy's current version and raises otherwise, so a missing
       callback or a failed push can never silently sample old weights;
    4. ``close()`` at teardown.
    """

    #: Short name usable in YAML (``data.sampler: hf_generate``).
    name: ClassVar[str] = ""
    #: True when ``Rollout.sampling_logprobs`` is filled (enables sampler-side IS correction).
    provides_logprobs: ClassVar[bool] = False
    #: True for back-ends with their own copy of the weights (vLLM, a remote server): they need
    #: ``on_policy_updated`` after each optimizer step. False for back-ends that read the live
    #: policy (HF generate), which always serve the current version.
    keeps_own_weights: ClassVar[bool] = False
    #: Names of the ``Rollout.extra`` fields this back-end fills (an agent's ``turns``, a tool
    #: result, ...): reward functions receive them as columns, and may require them by name.
    rollout_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        self._handle: PolicyHandle | None = None
        self._served_version: int | None = None

    def bind(self, handle: PolicyHandle) -> None:
        """Attach the live policy (model, tokenizer, device, version)."""
        self._handle = handle

    @property
    def handle(self) -> PolicyHandle:
        if self._handle is None:
            raise RuntimeError(
                f"{type(self).__name__} is not bound to a policy: call sampler.bind(handle) "
                "before generate() (the datamodule does this when training starts)."
            )
        return self._handle

    @property
    def max_sequence_length(self) -> int | None:
        """The longest prompt + completion the back-end itself accepts (a vLLM engine's or
        server's ``max_model_len``); ``None`` when only the model's own context bounds it."""
        return None

    def check_generation(self, params: GenerationParams) -> None:
        """Refuse, at start-up, ``params`` this back-end cannot sample with as configured (the
        ``generation_kwargs`` checks of :mod:`~grpo_lightning.samplers.generation_checks`); the
        datamodule calls it before any model work. Back-ends add the keys they own or know."""
        check_generation_kwargs(params)

    def lockstep_calls(self, count: int) -> int:
        """How many ``generate`` calls this rank makes when it needs ``count``: more where ranks
        share one engine (vLLM colocated with tensor parallelism), whose calls are collectives
        every rank of the group must join; a rank pads with calls of no prompts. ``count`` here."""
        return count

    @property
    def served_version(self) -> int | None:
        """The policy version (optimizer step) whose weights ``generate`` samples from; ``None``
        before a back-end with its own weights received any."""
        if not self.keeps_own_weights:
            return self.handle.policy_version  # the live policy is always current
        return self._served_version

    def on_policy_updated(self, handle: PolicyHandle, version: int) -> None:
        """Serve the policy at ``version`` from now on: push its weights (``push_weights``) and
        record the version. Raises if the push fails; never returns with old weights served."""
        if self.keeps_own_weights:
            self.push_weights(handle, version)
        self._served_version = version

    def push_weights(self, handle: PolicyHandle, version: int) -> None:
        """Copy the policy's current weights into the back-end and verify they are served
        (back-ends with ``keeps_own_weights`` override this). Runs inside
        ``handle.generation_context()`` when weights are sharded."""
        raise NotImplementedError(f"{type(self).__name__} keeps its own weights but does not implement push_weights.")

    @abstractmethod
    def generate(
        self, prompts: Sequence[PromptInput], num_generations: int, params: GenerationParams
    ) -> list[Rollout]:
        """Sample ``num_generations`` completions for each prompt.

        Returns ``len(prompts) * num_generations`` rollouts, prompt-major: the completions of
        prompt 0 first, then those of prompt 1, and so on.
        """

    def close(self) -> None:
        """Release the back-end's resources (engines, servers, threads) at teardown."""
