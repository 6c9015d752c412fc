"""One rank of the ZeRO-3 checks against a real DeepSpeed engine on CPU, without Lightning.

    RANK=r WORLD_SIZE=w MASTER_PORT=p python tests/module/deepspeed_zero3_child.py <model_dir> <out_dir>

The policy is built the way ``GRPODeepSpeedStrategy`` builds it (transformers' ZeRO-3 switch on,
inside ``deepspeed.zero.Init``), wrapped with a frozen reference in one module, and handed to a
stage-3 engine. Every check compares against a dense copy loaded normally; the rank writes what it
saw to ``<out_dir>/zero3_<rank>.json`` for tests/module/test_deepspeed_zero3.py to judge.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import deepspeed  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402

from grpo_lightning.module.deepspeed_zero3 import zero3_generation_context  # noqa: E402
from grpo_lightning.module.sharding import full_state_dict, gathered_weights  # noqa: E402
from grpo_lightning.samplers.vllm_common import policy_weight_shapes, policy_weights  # noqa: E402
from grpo_lightning.utils.zero3 import is_partitioned  # noqa: E402

CONFIG = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_allow_untested_optimizer": True,
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # partition every tensor


class Pair(torch.nn.Module):
    """Policy and reference in one module, as in GRPOModule."""

    def __init__(self, policy: torch.nn.Module, reference: torch.nn.Module) -> None:
        super().__init__()
        self.policy, self.reference = policy, reference


class Handle:
    def __init__(self, policy: torch.nn.Module) -> None:
        self.policy = policy


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


def main(model_dir: str, out_dir: str) -> None:
    deepspeed.init_distributed(dist_backend="gloo")
    rank = torch.distributed.get_rank()
    dense = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    switch = HfDeepSpeedConfig(CONFIG)  # noqa: F841 - transformers reads it through a weak reference
    with deepspeed.zero.Init(config_dict_or_path=CONFIG):
        policy = AutoModelForCausalLM.from_pretrained(model_dir)
        reference = AutoModelForCausalLM.from_pretrained(model_dir).requires_grad_(False)
    policy.eval()
    engine, *_ = deepspeed.initialize(model=Pair(policy, reference), config=CONFIG, dist_init_required=False,
                                      optimizer=torch.optim.SGD([p for p in policy.parameters()], lr=0.1))
    result: dict = {"rank": rank, "partitioned_at_start": all(is_partitioned(p) for p in policy.parameters())}
    offload = engine.optimizer.parameter_offload
    hooks_before = len(offload.forward_hooks)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        dense_logits = dense(ids).logits
        dense_greedy = dense.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0).tolist()

        # gather once: whole weights, no hooks; a forward leaves them whole
        with zero3_generation_context(policy, engine, gather=True):
            result["gather_whole_inside"] = not any(is_partitioned(p) for p in policy.parameters())
            result["gather_hooks_inside"] = len(offload.forward_hooks)
            result["gather_logits_diff"] = float((policy(ids).logits - dense_logits).abs().max())
            result["gather_whole_after_forward"] = not any(is_partitioned(p) for p in policy.parameters())
            greedy = policy.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, synced_gpus=False).tolist()
            result["gather_greedy_equal"] = greedy == dense_greedy
            # a weight push inside the generation context: no nested gather, whole tensors
            with policy_weights(Handle(policy)) as weights:
                pushed = {name: t.clone() for name, t in weights}
            result["push_inside_diff"] = max_diff(pushed, dense.state_dict())
        result["repartitioned_after"] = all(is_partitioned(p) for p in policy.parameters())
        result["hooks_restored"] = len(offload.forward_hooks) == hooks_before and hooks_before > 0

        # generate sharded: the engine's hooks fetch every module's weights at each forward
        with zero3_generation_context(policy, engine, gather=False):
            result["sharded_partitioned_inside"] = all(is_partitioned(p) for p in policy.parameters())
            result["sharded_logits_diff"] = float((policy(ids).logits - dense_logits).abs().max())
            greedy = policy.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0).tolist()
            result["sharded_greedy_equal"] = greedy == dense_greedy

        # weight pushes outside any gather: one tensor at a time, whole shapes announced
        with policy_weights(Handle(policy)) as weights:
            pushed = {name: t.clone() for name, t in weights}
        result["push_diff"] = max_diff(pushed, dense.state_dict())
        result["push_keys_equal"] = sorted(pushed) == sorted(dense.state_dict())
        shapes = {name: list(shape) for name, _, shape in policy_weight_shapes(Handle(policy))}
        result["shapes_equal"] = shapes == {k: list(v.shape) for k, v in dense.state_dict().items()}

        # the export: whole CPU tensors on rank 0, nothing kept elsewhere
        state = full_state_dict(policy)
        result["export_keys"] = len(state)
        if state:
            result["export_diff"] = max_diff(state, dense.state_dict())
            result["export_on_cpu"] = all(t.device.type == "cpu" for t in state.values())
            result["export_shapes_equal"] = all(state[k].shape == v.shape for k, v in dense.state_dict().items())

        # writeback: rank 0's change reaches every rank's shard
        weight = policy.model.embed_tokens.weight
        with gathered_weights(policy.model.embed_tokens, writeback=True):
            if rank == 0:
                weight.data.add_(1.0)
        with gathered_weights(policy.model.embed_tokens):
            result["writeback_diff"] = float((weight - dense.model.embed_tokens.weight - 1.0).abs().max())
    Path(out_dir, f"zero3_{rank}.json").write_text(json.dumps(result))
    # Tear the group down before the interpreter does: left to exit, its gloo threads were once
    # destroyed while joinable ("terminate called without an active exception", SIGABRT) after
    # both ranks had written their results.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
