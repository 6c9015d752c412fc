"""Generation back-ends, registered lazily by dotted path (like the reward functions).

``SAMPLERS`` maps a YAML short name to the dotted path of its class; a back-end's heavy imports
(vLLM, ...) happen only when it is chosen. A config may also name any ``Sampler`` subclass by
``class_path`` (or a Python caller may pass an instance).
"""

from __future__ import annotations

import importlib

from grpo_lightning.samplers.base import Sampler
from grpo_lightning.samplers.hf_generate import HFGenerateSampler

SAMPLERS: dict[str, str] = {
    HFGenerateSampler.name: "grpo_lightning.samplers.hf_generate.HFGenerateSampler",
    "continuous_batching": "grpo_lightning.samplers.continuous_batching.ContinuousBatchingSampler",
    "fast_generate": "grpo_lightning.samplers.fast_generate.FastGenerateSampler",
    "vllm_colocate": "grpo_lightning.samplers.vllm_colocate.VLLMColocateSampler",
    "vllm_server": "grpo_lightning.samplers.vllm_server.VLLMServerSampler",
    "rollout_func": "grpo_lightning.samplers.rollout_func.RolloutFuncSampler",
}


def sampler_class(name_or_path: str) -> type[Sampler]:
    """The ``Sampler`` subclass for a short name (``"hf_generate"``) or a dotted class path.

    >>> sampler_class("hf_generate").__name__
    'HFGenerateSampler'
    >>> sampler_class("grpo_lightning.samplers.hf_generate.HFGenerateSampler").name
    'hf_generate'
    """
    path = SAMPLERS.get(name_or_path, name_or_path)
    module_name, _, attribute = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attribute) if module_name else None
    except (ImportError, AttributeError) as err:
        raise ValueError(
            f"data.sampler={name_or_path!r} could not be imported ({err}). Use one of {sorted(SAMPLERS)} or the "
            "dotted path of a Sampler subclass."
        ) from err
    if not (isinstance(cls, type) and issubclass(cls, Sampler)):
        raise ValueError(
            f"data.sampler={name_or_path!r} is not a known sampler. Use one of {sorted(SAMPLERS)} or the dotted "
            "path of a Sampler subclass."
        )
    return cls


def get_sampler(sampler: "str | Sampler") -> Sampler:
    """Resolve a sampler given by short name, dotted class path (default knobs), or as an instance."""
    if isinstance(sampler, Sampler):
        return sampler
    return sampler_class(sampler)()


__all__ = ["SAMPLERS", "HFGenerateSampler", "Sampler", "get_sampler", "sampler_class"]
