"""Child of test_ref_model_sync_fsdp2: two gloo ranks shard a policy and a reference with FSDP2 (as
``configure_model`` does), run a no-grad reference forward (which can leave the root FSDP module
unsharded), mix with ``RefModelSync.sync`` and compare the gathered reference with the float64 mix
of the unsharded weights; a second reference, kept whole, takes the policy's gathered tensors.
Usage: python ref_sync_fsdp2_child.py PORT OUT_DIR"""

from types import SimpleNamespace

import torch

from tests.gloo_ranks import spawn_two_ranks

ALPHA = 0.6


def check(rank: int) -> list[str]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from grpo_lightning.callbacks import RefModelSync
    from grpo_lightning.module.sharding import shard_fsdp2
    from grpo_lightning.utils.tiny_models import build_tiny_causal_lm

    # vocab 21, hidden 32: the embedding's 21 rows do not split evenly over 2 ranks (padded shards)
    policy_whole, ref_whole = build_tiny_causal_lm(21, seed=1).state_dict(), build_tiny_causal_lm(21, seed=2).state_dict()
    mesh = init_device_mesh("cpu", (2,))
    policy, ref = build_tiny_causal_lm(21, seed=1), build_tiny_causal_lm(21, seed=2)
    for model in (policy, ref):
        shard_fsdp2(model, mesh)
    with torch.no_grad():
        ref(input_ids=torch.tensor([[4, 5, 6]]))
    RefModelSync(ALPHA).sync(SimpleNamespace(policy=policy, ref_policy=ref))
    mixed = get_model_state_dict(ref, options=StateDictOptions(full_state_dict=True))
    problems = []
    for name, value in ref_whole.items():
        expected = ((1 - ALPHA) * value.double() + ALPHA * policy_whole[name].double()).float()
        if not torch.equal(mixed[name], expected):
            problems.append(f"sharded reference, {name}: max diff {float((mixed[name] - expected).abs().max())}")
    whole = build_tiny_causal_lm(21, seed=2)  # a reference laid out unlike the policy
    RefModelSync(ALPHA).sync(SimpleNamespace(policy=policy, ref_policy=whole))
    for name, value in whole.state_dict().items():
        expected = ((1 - ALPHA) * ref_whole[name].double() + ALPHA * policy_whole[name].double()).float()
        if not torch.equal(value, expected):
            problems.append(f"whole reference, {name}")
    if not any(p.to_local().shape != p.shape for p in ref.parameters()):
        problems.append("nothing was sharded")
    return problems


if __name__ == "__main__":
    spawn_two_ranks(check)
