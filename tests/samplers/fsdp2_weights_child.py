"""Child of test_vllm_weights: two gloo ranks shard a tiny model with FSDP2 and check that
``policy_weights`` yields every whole tensor and ``policy_weight_shapes`` the global shapes.
Usage: python fsdp2_weights_child.py PORT OUT_DIR"""

from types import SimpleNamespace

import torch

from tests.gloo_ranks import spawn_two_ranks


def check(rank: int) -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    from grpo_lightning.module.sharding import shard_fsdp2
    from grpo_lightning.samplers.vllm_common import policy_weight_shapes, policy_weights
    from grpo_lightning.utils.tiny_models import build_tiny_causal_lm

    reference = build_tiny_causal_lm(16, seed=3).state_dict()
    model = build_tiny_causal_lm(16, seed=3)
    shard_fsdp2(model, init_device_mesh("cpu", (2,)))
    handle = SimpleNamespace(policy=model)
    sharded = [n for n, p in model.named_parameters() if p.to_local().shape != p.shape]
    shapes = policy_weight_shapes(handle)
    with policy_weights(handle) as weights:
        got = {name: tensor.clone() for name, tensor in weights}
    problems = [f"{n}: {tuple(t.shape)}" for n, t in got.items() if not torch.equal(t, reference[n])]
    problems += [f"shape {n}" for n, _, s in shapes if s != tuple(reference[n].shape)]
    if [n for n, _, _ in shapes] != list(got) or set(got) != set(reference):
        problems.append(f"names differ: {sorted(set(got) ^ set(reference))}")
    if not sharded:
        problems.append("nothing was sharded")
    return problems


if __name__ == "__main__":
    spawn_two_ranks(check, hard_exit=True)  # FSDP2's teardown aborted rank 1 now and then
