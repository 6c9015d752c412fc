"""Start-up checks of ``data.generation.generation_kwargs``: the extra back-end arguments that would
make a run train on something other than samples of the policy, or fail after the model loaded.

``generation_kwargs`` are merged last into the back-end's settings (``GenerationConfig``,
``SamplingParams``), so a key there can silently undo a setting the rest of the run relies on: a
``temperature`` the training log-probs do not use, ``num_return_sequences`` that misaligns
completions with prompts, beam search instead of sampling. Each is refused before any model work,
with the setting to use instead; keys the back-end does not know (typos) are refused too.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from grpo_lightning.errors import ConfigError
from grpo_lightning.types import GenerationParams

KWARGS_KEY = "data.generation.generation_kwargs"

#: Keys that repeat a ``data.generation`` field (``RolloutBatch`` carries the field's value: the
#: training log-probs divide by ``data.generation.temperature``) -> the field to set instead.
FIELD_KEYS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_completion_length",
    "max_tokens": "max_completion_length", "max_length": "max_completion_length",
}  # fmt: skip
#: Keys that ask for more than one completion per request: the group size is ``data.num_generations``.
GROUP_KEYS = ("num_return_sequences", "n", "best_of")
#: ``transformers`` settings our HF back-ends set or read themselves -> why they cannot be overridden.
HF_OWNED_KEYS = {
    "eos_token_id": "generation stops and completions are cut on the policy's own EOS ids (the tokenizer's "
                    "and the model generation config's); add a stop id there",
    "pad_token_id": "prompts are padded with the tokenizer's pad token; set it on the tokenizer",
    "bos_token_id": "it comes from the tokenizer",
    "return_dict_in_generate": "the sampler reads the generated ids itself",
    "stop_strings": "transformers needs the tokenizer for it and pads after the stop, which would be "
                    "trained on; use a vLLM sampler with generation_kwargs.stop, or an EOS id",
    "constraints": "constrained beam search does not sample",
    "force_words_ids": "constrained beam search does not sample",
    "penalty_alpha": "contrastive search does not sample",
}  # fmt: skip
#: vLLM ``SamplingParams`` fields the vLLM back-ends set themselves.
VLLM_OWNED_KEYS = {
    "logprobs": "the sampler asks for the sampled token's log-prob (the importance-sampling correction "
                "reads it)",
    "seed": "one seed for every request would repeat the same draws; the engine is seeded from the run's seed",
    "stop_token_ids": "generation stops on the policy's own EOS ids (the tokenizer's and the model generation "
                      "config's), which the sampler sets here; use stop for extra stop strings",
}  # fmt: skip


def check_generation_kwargs(params: GenerationParams) -> None:
    """Refuse ``generation_kwargs`` that no back-end can take without training on the wrong thing.

    >>> check_generation_kwargs(GenerationParams(generation_kwargs={"temperature": 0.7}))
    Traceback (most recent call last):
    ...
    grpo_lightning.errors.ConfigError: data.generation.generation_kwargs.temperature=0.7: set data.generation.temperature instead ...
    """
    kwargs = params.generation_kwargs or {}
    for key, value in kwargs.items():
        if key in FIELD_KEYS:
            field = FIELD_KEYS[key]
            raise ConfigError(
                f"{KWARGS_KEY}.{key}={value!r}: set data.generation.{field} instead (now "
                f"{getattr(params, field)!r}). The fields are what the rest of the run uses: the training "
                "log-probs divide by data.generation.temperature, and a key here would override it for "
                "sampling only."
            )
        if key in GROUP_KEYS:
            raise ConfigError(
                f"{KWARGS_KEY}.{key}={value!r}: the completions per prompt are data.num_generations; remove "
                f"'{key}' (each prompt is already asked for its group)."
            )
    beams = kwargs.get("num_beams", 1)
    if kwargs.get("do_sample", True) is False or (isinstance(beams, int) and beams > 1) or kwargs.get("use_beam_search"):
        raise ConfigError(
            f"{KWARGS_KEY}={dict(kwargs)!r}: GRPO learns from samples of the policy, not from greedy or beam "
            "search (the loss weights each completion by its probability under the sampling policy, and a "
            "deterministic group has no spread to learn from). Remove do_sample/num_beams/use_beam_search; "
            "for nearly greedy sampling lower data.generation.temperature."
        )


def check_backend_kwargs(
    params: GenerationParams, backend: str, known: Iterable[str] | None, owned: Mapping[str, str]
) -> None:
    """:func:`check_generation_kwargs`, then refuse the keys ``owned`` by the back-end (with why) and,
    when ``known`` is given, the keys it does not know (a typo would fail after the model loads, or
    be ignored)."""
    check_generation_kwargs(params)
    kwargs = params.generation_kwargs or {}
    for key, value in kwargs.items():
        if key in owned:
            raise ConfigError(f"{KWARGS_KEY}.{key}={value!r} cannot be set with {backend}: {owned[key]}.")
    if known is None:
        return
    known = set(known)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ConfigError(
            f"{KWARGS_KEY}: {unknown} {'is' if len(unknown) == 1 else 'are'} not a setting of {backend}. "
            f"Check the spelling; it takes e.g. {sorted(k for k in known if not k.startswith('_'))[:12]} ..."
        )


def hf_generation_keys() -> set[str]:
    """The settings ``transformers.GenerationConfig`` knows (its attributes)."""
    from transformers import GenerationConfig

    return {k for k in vars(GenerationConfig()) if not k.startswith("_")}


def check_hf_generation(params: GenerationParams, backend: str) -> None:
    """The checks of a ``transformers``-based back-end (HF generate, continuous batching, fast generate)."""
    check_backend_kwargs(params, backend, hf_generation_keys(), HF_OWNED_KEYS)
    check_cache_implementation((params.generation_kwargs or {}).get("cache_implementation"),
                               f"{KWARGS_KEY}.cache_implementation")


def check_vllm_generation(params: GenerationParams, backend: str, known: Iterable[str] | None) -> None:
    """The checks of a vLLM back-end; ``known``: the field names it takes (:func:`vllm_sampling_keys`),
    ``None`` to leave the names to the engine (a remote server)."""
    check_backend_kwargs(params, backend, known, VLLM_OWNED_KEYS)


def check_cache_implementation(name: str | None, setting: str = "cache_implementation") -> None:
    """A KV-cache implementation ``transformers`` knows (``static``, ``dynamic``, ...), or ``None``."""
    if name is None:
        return
    from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS

    if name not in ALL_CACHE_IMPLEMENTATIONS:
        raise ValueError(f"{setting}={name!r}: use one of {list(ALL_CACHE_IMPLEMENTATIONS)}, or null for the "
                         "model's default dynamic cache.")
