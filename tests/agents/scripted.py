"""A scripted policy for agent tests: a Sampler whose completions are chosen by a function of
the context text, tokenized with the real tokenizer and closed with EOS (exact ids, no model)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from grpo_lightning.samplers.base import Sampler
from grpo_lightning.types import Rollout


class ScriptedSampler(Sampler):
    """``script(context_text, k)`` is the text of the ``k``-th completion a call returns (prompt ``i``,
    generation ``j``: ``k = i * num_generations + j``) of its context (prompt plus the completion so
    far); it gets EOS appended, and is cut at ``max_completion_length``.

    Every call is recorded in ``calls`` as ``(contexts, num_generations, max_completion_length)``.
    With ``logprobs``, token ``i`` of a turn reports log-prob ``-(i + 1) / 10``.
    """

    max_sequence_length: int | None = None  # a back-end's own limit (a vLLM max_model_len), settable

    def __init__(self, script: Callable[[str, int], str], logprobs: bool = False) -> None:
        super().__init__()
        self.script = script
        self.provides_logprobs = logprobs
        self.calls: list[tuple[list[list[int]], int, int]] = []

    def generate(self, prompts, num_generations, params):
        tokenizer = self.handle.tokenizer
        self.calls.append(([list(p) for p in prompts], num_generations, params.max_completion_length))
        out = []
        for prompt in prompts:
            context = tokenizer.decode(list(prompt))
            for _ in range(num_generations):
                ids = tokenizer(self.script(context, len(out)), add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                ids = ids[: params.max_completion_length]
                ended = ids[-1] == tokenizer.eos_token_id
                logprobs = [-(i + 1) / 10 for i in range(len(ids))] if self.provides_logprobs else None
                out.append(Rollout(list(prompt), ids, ended, self.handle.policy_version, logprobs))
        return out


@dataclass
class Handle:
    """The PolicyHandle members the agent loop and the builder use, without a model."""

    tokenizer: Any
    device: torch.device = torch.device("cpu")
    policy_version: int = 0
    needs_reference_logprobs: bool = False
    max_context_length: int | None = None
    eos_token_ids: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        self.eos_token_ids = self.eos_token_ids or (self.tokenizer.eos_token_id,)

    def rollout_logprobs(self, batch, *, reference, chunk_size):
        raise AssertionError("not needed")


def call(name: str, **arguments: Any) -> str:
    """A Qwen tool-call block, formatted as the chat template renders one."""
    import json

    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'
