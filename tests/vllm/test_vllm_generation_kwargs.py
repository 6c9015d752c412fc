"""With vLLM installed, a vLLM sampler knows the names of ``SamplingParams``: a typo in
``data.generation.generation_kwargs`` fails at start-up, not at the first generation."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="needs vLLM: make test-vllm runs this in .venv-vllm")

from grpo_lightning.errors import ConfigError  # noqa: E402
from grpo_lightning.samplers.vllm_common import vllm_sampling_keys  # noqa: E402
from grpo_lightning.samplers.vllm_colocate import VLLMColocateSampler  # noqa: E402
from grpo_lightning.types import GenerationParams  # noqa: E402


def kwargs(**values) -> GenerationParams:
    return GenerationParams(max_completion_length=4, generation_kwargs=values)


def test_sampling_params_fields_are_the_known_names():
    known = vllm_sampling_keys()
    assert {"stop", "presence_penalty", "structured_outputs", "ignore_eos"} <= known
    assert not any(name.startswith("_") for name in known)  # private fields are no settings


def test_real_settings_pass_and_a_typo_is_refused():
    sampler = VLLMColocateSampler()
    sampler.check_generation(kwargs(stop=["\n\n"], presence_penalty=0.1, structured_outputs={"regex": "a+"}))
    with pytest.raises(ConfigError, match=r"\['presense_penalty'\] is not a setting of data\.sampler: vllm_colocate"):
        sampler.check_generation(kwargs(presense_penalty=0.1))
    with pytest.raises(ConfigError, match=r"not a setting"):
        sampler.check_generation(kwargs(_eos_token_id=3))
