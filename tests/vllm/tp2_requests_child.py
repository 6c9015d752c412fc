"""Two gloo ranks sharing one colocated vLLM engine (``tensor_parallel_size=2``, vLLM's
``external_launcher`` on the ranks' group), asked for different things in the same call, as the
tool loop's ranks do: other prompts, other lengths, no prompts at all.

    python tests/vllm/tp2_requests_child.py PORT OUT_DIR MODEL_DIR
"""

from __future__ import annotations

import sys

from tests.gloo_ranks import spawn_two_ranks

ENGINE = dict(dtype="float32", kv_cache_memory_gib=0.25, max_model_length=128, gpu_memory_utilization=0.3,
              sync_timeout_s=60.0, engine_kwargs={"enforce_eager": True})


def check(rank: int) -> list[str]:
    from grpo_lightning.samplers.vllm_colocate import VLLMColocateSampler
    from grpo_lightning.types import GenerationParams
    from tests.vllm.engines import pushed_module

    sampler = VLLMColocateSampler(tensor_parallel_size=2, **ENGINE)
    handle = pushed_module(sys.argv[3], sampler)
    problems: list[str] = []
    try:
        # one call, each rank its own prompts, completions per prompt and length (top_k=1: greedy)
        texts = ["1+2="] if rank == 0 else ["3+4=", "5+6="]
        prompts = [handle.tokenizer(t).input_ids for t in texts]
        length, n = (3, 2) if rank == 0 else (9, 1)
        rollouts = sampler.generate(prompts, n, GenerationParams(max_completion_length=length, top_k=1))
        if [r.prompt_ids for r in rollouts] != [p for p in prompts for _ in range(n)]:
            problems.append(f"rank {rank}: rollouts of other prompts")
        lengths = [len(r.completion_ids) for r in rollouts]
        if any(k > length or (k < length and not r.ended_on_eos) for k, r in zip(lengths, rollouts)):
            problems.append(f"rank {rank}: lengths {lengths} for max_completion_length={length}")
        # the same prompt asked alone for the same length gives the same greedy tokens
        alone = sampler.generate(prompts[:1], 1, GenerationParams(max_completion_length=length, top_k=1))
        if alone[0].completion_ids != rollouts[0].completion_ids:
            problems.append(f"rank {rank}: {alone[0].completion_ids} alone, {rollouts[0].completion_ids} in the group")
        # a padding call: rank 1 asks nothing while rank 0 asks; then neither asks
        mine = sampler.generate(prompts[:1] if rank == 0 else [], 1, GenerationParams(max_completion_length=4))
        if len(mine) != (1 if rank == 0 else 0):
            problems.append(f"rank {rank}: {len(mine)} rollouts of a call with {1 - rank} prompts")
        if sampler.generate([], 1, GenerationParams(max_completion_length=4)) != []:
            problems.append(f"rank {rank}: an empty call returned rollouts")
        calls = sampler.lockstep_calls(1 if rank == 0 else 3)
        if calls != 3:
            problems.append(f"rank {rank}: lockstep_calls gave {calls}, expected the group's most (3)")
    finally:
        sampler.close()
    import torch.distributed as dist

    if not dist.is_initialized():  # vLLM's shutdown destroys the default group unless kept
        problems.append(f"rank {rank}: closing the engine destroyed the trainer's process group")
    return problems


if __name__ == "__main__":
    spawn_two_ranks(check)
