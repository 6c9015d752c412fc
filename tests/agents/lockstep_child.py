"""Two gloo ranks sharing one "engine" in the tool loop (vLLM colocated with tensor parallelism:
every generate call is a collective of the group). Rank 0's rollout calls a tool twice, rank 1's
answers at once; both must run as many generation calls, rank 1 padding with empty ones.

    GRPO_SHARED_ASSETS=... python tests/agents/lockstep_child.py PORT OUT_DIR
"""

from __future__ import annotations

import os
from pathlib import Path

import torch.distributed as dist

from tests.gloo_ranks import spawn_two_ranks


def check(rank: int) -> list[str]:
    from transformers import AutoTokenizer

    from grpo_lightning.agents import NUM_TOOL_CALLS, AgentSampler, Episode
    from grpo_lightning.types import GenerationParams
    from tests.agents.scripted import Handle, ScriptedSampler, call
    from tests.agents.test_tool_loop import KWARGS, TOOLS, USER

    class SharedEngine(ScriptedSampler):
        """Every call gathers the group's prompts first, as a TP-shared vLLM engine does."""

        def generate(self, prompts, num_generations, params):
            group: list = [None, None]
            dist.all_gather_object(group, [list(p) for p in prompts])
            return super().generate(prompts, num_generations, params)

        def lockstep_calls(self, count: int) -> int:
            counts: list = [None, None]
            dist.all_gather_object(counts, count)
            return max(counts)

    def script(context: str, k: int) -> str:
        if rank == 1 or context.count("<tool_response>") == 2:
            return "12."
        return call("multiply", a=3, b=4)

    tokenizer = AutoTokenizer.from_pretrained(str(Path(os.environ["GRPO_SHARED_ASSETS"], "tokenizers", "qwen2.5")))
    inner = SharedEngine(script)
    sampler = AgentSampler(inner, TOOLS, chat_template_kwargs=KWARGS)
    sampler.bind(Handle(tokenizer))
    prompt = sampler.render_prompt(USER, TOOLS)
    (rollout,) = sampler.run([Episode(list(prompt), TOOLS)], GenerationParams(max_completion_length=200), 1)
    problems = []
    calls = [len(contexts) for contexts, _, _ in inner.calls]
    if calls != ([1, 1, 1] if rank == 0 else [1, 0, 0]):
        problems.append(f"rank {rank}: generation calls of {calls} prompts")
    expected_calls = 2 if rank == 0 else 0
    if rollout.extra[NUM_TOOL_CALLS] != expected_calls:
        problems.append(f"rank {rank}: {rollout.extra[NUM_TOOL_CALLS]} tool calls, expected {expected_calls}")
    if not rollout.ended_on_eos or tokenizer.decode(rollout.completion_ids).count("<tool_response>") != expected_calls:
        problems.append(f"rank {rank}: completion {tokenizer.decode(rollout.completion_ids)!r}")
    return problems


if __name__ == "__main__":
    spawn_two_ranks(check)
