"""The ``Sampler`` interface: how a generation back-end plugs into the data side.

Layer L2. A sampler turns tokenized prompts into :class:`~grpo_lightning.types.Rollout` records.
Token in, token out: the completion ids it returns are the ids trained on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Sequence

from grpo_lightning.types import GenerationParams, PolicyHandle, PromptInput, Rollout


class Sampler(ABC):
    """Base class of generation back-ends (HF generate, continuous batching, vLLM, ...).

    Lifecycle: ``bind(handle)`` once when training starts, then ``generate`` for every generation
    batch; ``on_policy_updated`` whenever the optimizer has changed the policy and a back-end that
    keeps its own copy of the weights (vLLM) must refresh them before the next ``generate``.
    """

    #: Short name usable in YAML (``data.sampler: hf_generate``).
    name: ClassVar[str] = ""
    #: True when ``Rollout.sampling_logprobs`` is filled (enables sampler-side IS correction).
    provides_logprobs: ClassVar[bool] = False

    def __init__(self) -> None:
        self._handle: PolicyHandle | None = None

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

    @abstractmethod
    def generate(
        self, prompts: Sequence[PromptInput], num_generations: int, params: GenerationParams
    ) -> list[Rollout]:
        """Sample ``num_generations`` completions for each prompt.

        Returns ``len(prompts) * num_generations`` rollouts, prompt-major: the completions of
        prompt 0 first, then those of prompt 1, and so on.
        """

    def on_policy_updated(self, policy_version: int) -> None:
        """Called before generating when the policy changed since the last call. In-process
        samplers that read the live model need nothing here."""
