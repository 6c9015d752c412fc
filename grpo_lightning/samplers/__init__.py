"""Generation back-ends. ``SAMPLERS`` maps the YAML short names to classes."""

from grpo_lightning.samplers.base import Sampler
from grpo_lightning.samplers.hf_generate import HFGenerateSampler

SAMPLERS: dict[str, type[Sampler]] = {HFGenerateSampler.name: HFGenerateSampler}


def get_sampler(sampler: "str | Sampler") -> Sampler:
    """Resolve a sampler given by short name (``"hf_generate"``) or as an instance."""
    if isinstance(sampler, Sampler):
        return sampler
    if sampler not in SAMPLERS:
        raise ValueError(
            f"data.sampler={sampler!r} is not a known sampler. Use one of {sorted(SAMPLERS)} or a "
            "class_path to a Sampler subclass."
        )
    return SAMPLERS[sampler]()


__all__ = ["SAMPLERS", "HFGenerateSampler", "Sampler", "get_sampler"]
