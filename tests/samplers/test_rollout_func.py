"""``RolloutFuncSampler``: TRL's ``rollout_func`` as a sampler. A function that samples from the
live policy through its context, extra fields reaching the rewards, every check of the returned
dict, and a short ``grpo fit`` that selects the function from YAML."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from grpo_lightning.module import GRPOModule
from grpo_lightning.samplers import get_sampler, sampler_class
from grpo_lightning.samplers.rollout_func import RolloutContext, RolloutFuncSampler
from grpo_lightning.types import GenerationParams
from tests.helpers import built, make_model_dir, write_prompts

SEEN: dict[str, list] = {}


def policy_rollout(prompts, ctx: RolloutContext):
    """Samples ``ctx.num_generations`` completions per prompt from the live policy with
    ``generate``, cut after the first EOS, with each token's log-prob from the processed scores."""
    tokenizer, params = ctx.tokenizer, ctx.params
    rows = [p for p in prompts for _ in range(ctx.num_generations)]
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])  # (R, Tp) left-padded
    attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    with ctx.generating():
        out = ctx.policy.generate(
            input_ids=input_ids.to(ctx.device), attention_mask=attention_mask.to(ctx.device), do_sample=True,
            max_new_tokens=params.max_completion_length, temperature=params.temperature, top_k=0, top_p=1.0,
            eos_token_id=list(ctx.eos_token_ids), pad_token_id=tokenizer.pad_token_id,
            output_scores=True, return_dict_in_generate=True,
        )
    new = out.sequences[:, width:]  # (R, T)
    logps = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # (R, T)
    completion_ids, logprobs = [], []
    for ids, lps in zip(new.tolist(), logps.tolist()):
        end = next((i + 1 for i, t in enumerate(ids) if t in ctx.eos_token_ids), len(ids))
        completion_ids.append(ids[:end])
        logprobs.append(lps[:end])
    tags = [f"p{i // ctx.num_generations}g{i % ctx.num_generations}" for i in range(len(rows))]
    return {"prompt_ids": rows, "completion_ids": completion_ids, "logprobs": logprobs, "tag": tags,
            "source": "policy", "version": [ctx.policy_version] * len(rows)}


def tag_reward(completions, tag, source, **kwargs):
    """Reads the function's extra fields: ``tag`` (one per completion) and ``source`` (one for all)."""
    SEEN.setdefault("tag", []).extend(tag)
    SEEN.setdefault("source", []).extend(source)
    return [float(len(c)) for c in completions]


def _module(tmp_path: Path) -> GRPOModule:
    return built(GRPOModule(make_model_dir(tmp_path / "m"), save_final_model=False))


def _sampler(module, func=policy_rollout, **kwargs) -> RolloutFuncSampler:
    sampler = RolloutFuncSampler(func, **kwargs)
    sampler.bind(module)
    return sampler


def test_a_rollout_func_sampling_the_live_policy(tmp_path):
    torch.manual_seed(0)
    module = _module(tmp_path)
    sampler = _sampler(module, "tests.samplers.test_rollout_func.policy_rollout", rollout_fields=["tag"])
    assert sampler.rollout_func is policy_rollout and sampler.provides_logprobs and sampler.rollout_fields == ("tag",)
    prompts = [module.tokenizer(p)["input_ids"] for p in ("1+2=", "33+4=")]
    params = GenerationParams(max_completion_length=6)
    rollouts = sampler.generate(prompts, 3, params)
    assert len(rollouts) == 6
    eos = set(module.eos_token_ids)
    for i, r in enumerate(rollouts):
        assert r.prompt_ids == prompts[i // 3]  # prompt-major
        assert r.extra == {"tag": f"p{i // 3}g{i % 3}", "source": "policy", "version": 0}
        assert len(r.sampling_logprobs) == len(r.completion_ids) >= 1 and r.policy_version == 0
        assert r.ended_on_eos == (r.completion_ids[-1] in eos)
        assert r.ended_on_eos or len(r.completion_ids) == 6
    # The sampler log-probs are the policy's own (float64 recomputation from the logits).
    r = rollouts[0]
    ids = torch.tensor([r.prompt_ids + r.completion_ids])
    with torch.no_grad():
        logits = module.policy.double()(ids).logits[0, len(r.prompt_ids) - 1 : -1]  # (Tc, V)
    expected = logits.log_softmax(-1).gather(-1, ids[0, len(r.prompt_ids):, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(r.sampling_logprobs, dtype=torch.float64), expected, atol=1e-5, rtol=0)


def test_registered_by_short_name_and_needs_a_function():
    assert sampler_class("rollout_func") is RolloutFuncSampler
    with pytest.raises(ValueError, match=r"needs rollout_func: .*init_args: \{rollout_func"):
        get_sampler("rollout_func")
    with pytest.raises(ValueError, match="cannot import 'no_such_pkg.fn'"):
        RolloutFuncSampler("no_such_pkg.fn")
    with pytest.raises(ValueError, match="is not callable"):
        RolloutFuncSampler("tests.samplers.test_rollout_func.SEEN")
    with pytest.raises(ValueError, match=r"rollout_fields=\['completions'\]"):
        RolloutFuncSampler(policy_rollout, rollout_fields=["completions"])


class _Handle:
    """The few handle members the checks use (no model needed)."""

    policy_version = 4
    eos_token_ids = (2,)
    device = torch.device("cpu")
    tokenizer = type("Tok", (), {"pad_token_id": 0})()


PROMPTS = [[5, 6], [7]]


def _good(**overrides):
    """A valid output for PROMPTS x 2 generations, with ``overrides`` applied (None removes a key)."""
    out = {
        "prompt_ids": [[5, 6], [5, 6], [7], [7]],
        "completion_ids": [[9, 2], [9, 9, 9], [2], [8, 0]],
        "logprobs": [[-0.1, -0.2], [-1.0, -1.0, -1.0], [-0.5], [-0.3, -0.4]],
    }
    out.update(overrides)
    return {k: v for k, v in out.items() if v is not None}


def _convert(output, **kwargs):
    sampler = RolloutFuncSampler(lambda prompts, ctx: output, **kwargs)
    sampler.bind(_Handle())
    return sampler.generate(PROMPTS, 2, GenerationParams())


def test_a_valid_output_becomes_rollouts():
    env_mask = [[1, 1], [1, 0, 1], [1], [1, 1]]
    rollouts = _convert(_good(env_mask=env_mask, logprob_token_ids=[[9, 2], [9, 9, 9], [2], [8, 0]], turns=[1, 2, 3, 4],
                              task="add"))
    assert [r.completion_ids for r in rollouts] == [[9, 2], [9, 9, 9], [2], [8, 0]]
    assert [r.ended_on_eos for r in rollouts] == [True, False, True, True]  # EOS 2 or pad 0 ends, as in TRL
    assert [r.tool_mask for r in rollouts] == env_mask  # env_mask is the tool mask, not a reward column
    assert [r.extra["turns"] for r in rollouts] == [1, 2, 3, 4]
    assert [r.extra["task"] for r in rollouts] == ["add"] * 4  # a non-list value reaches every completion
    assert rollouts[1].extra["logprob_token_ids"] == [9, 9, 9] and "env_mask" not in rollouts[0].extra
    assert [r.sampling_logprobs for r in rollouts][3] == [-0.3, -0.4] and {r.policy_version for r in rollouts} == {4}
    # Tensors are accepted where lists are expected.
    tensors = _good(completion_ids=[torch.tensor([9, 2]), torch.tensor([9]), torch.tensor([2]), torch.tensor([8])],
                    logprobs=[torch.tensor([-0.1, -0.2]), [-1.0], [-0.5], [-0.3]])
    assert _convert(tensors)[0].sampling_logprobs == pytest.approx([-0.1, -0.2])


def test_logprobs_may_be_absent_when_the_sampler_says_so():
    rollouts = _convert(_good(logprobs=None), provides_logprobs=False)
    assert all(r.sampling_logprobs is None for r in rollouts)
    assert _convert(_good(logprobs=None) | {"logprobs": None}, provides_logprobs=False)[0].sampling_logprobs is None


BAD_OUTPUTS = {
    "not a dict": ([1, 2], r"returned a list; it must return a dict with the keys prompt_ids, completion_ids, logprobs"),
    "missing logprobs": (_good(logprobs=None), r"returned no \['logprobs'\] \(or set provides_logprobs: false"),
    "missing keys": ({"completion_ids": []}, r"returned no \['prompt_ids', 'logprobs'\].*returned the keys \['completion_ids'\]"),
    "logprobs None": (_good(logprobs=None) | {"logprobs": None}, r"returned logprobs=None; .*provides_logprobs: false"),
    "too few rows": (_good(completion_ids=[[2], [2], [2]]),
                     r"'completion_ids' has 3 entries for 2 prompts x 2 generations; expected 4, one per completion"),
    "column not a list": (_good(prompt_ids="5 6"), r"'prompt_ids' is a str; expected a list with one entry per completion \(4\)"),
    "row not a list": (_good(completion_ids=[[9, 2], 9, [2], [8]]), r"completion_ids\[1\] is a int; expected a list of token ids"),
    "not an id": (_good(completion_ids=[[9, 2], [9, 1.5, 9], [2], [8, 0]]), r"completion_ids\[1\]\[1\] is 1.5; expected a token id"),
    "negative id": (_good(completion_ids=[[9, 2], [9, 9, 9], [-100], [8, 0]]), r"completion_ids\[2\]\[0\] is -100"),
    "empty completion": (_good(completion_ids=[[9, 2], [9, 9, 9], [], [8, 0]]), r"completion_ids\[2\] is empty"),
    "wrong prompt": (_good(prompt_ids=[[5, 6], [7], [7], [7]]),
                     r"prompt_ids\[1\] is not the ids of its prompt \(prompt 0: .*2 per prompt\); they differ from token 0"),
    "logprob length": (_good(logprobs=[[-0.1, -0.2], [-1.0], [-0.5], [-0.3, -0.4]]),
                       r"logprobs\[1\] has 1 entries but completion_ids\[1\] has 3 tokens"),
    "logprob nan": (_good(logprobs=[[-0.1, float("nan")], [-1.0] * 3, [-0.5], [-0.3, -0.4]]),
                    r"logprobs\[0\]\[1\] is nan; expected a finite float"),
    "logprob none": (_good(logprobs=[[-0.1, -0.2], [-1.0] * 3, [None], [-0.3, -0.4]]), r"logprobs\[2\]\[0\] is None"),
    "env_mask length": (_good(env_mask=[[1, 1], [1], [1], [1, 1]]), r"env_mask\[1\] has 1 entries but completion_ids\[1\] has 3"),
    "env_mask values": (_good(env_mask=[[1, 1], [1, 2, 1], [1], [1, 1]]), r"env_mask\[1\] has values other than 0 and 1 \(\[1, 2\]\)"),
    "logprob_token_ids length": (_good(logprob_token_ids=[[9, 2], [9, 9, 9], [2, 2], [8, 0]]),
                                 r"logprob_token_ids\[2\] has 2 entries but completion_ids\[2\] has 1"),
    "extra length": (_good(turns=[1, 2]), r"'turns' has 2 entries for 2 prompts x 2 generations; expected 4"),
    "reserved extra": (_good(completions=["a"] * 4), r"extra fields \['completions'\], which are not usable as reward columns"),
}


@pytest.mark.parametrize("case", BAD_OUTPUTS, ids=str)
def test_each_bad_output_gets_one_clear_error(case):
    output, message = BAD_OUTPUTS[case]
    with pytest.raises(ValueError, match=message) as err:
        _convert(output)
    assert str(err.value).startswith("rollout_func tests.samplers.test_rollout_func.")  # names the function


def test_declared_fields_must_be_returned_and_logprobs_must_be_wanted():
    with pytest.raises(ValueError, match=r"did not return the fields \['turns'\] listed in rollout_fields"):
        _convert(_good(), rollout_fields=["turns"])
    with pytest.raises(ValueError, match="returned logprobs but the sampler has provides_logprobs: false"):
        _convert(_good(), provides_logprobs=False)
    with pytest.raises(ValueError, match=re.escape("set check_prompt_ids: false")):
        _convert(_good(prompt_ids=[[5, 6, 1], [5, 6], [7], [7]]))
    assert _convert(_good(prompt_ids=[[5, 6, 1], [5, 6], [7], [7]]), check_prompt_ids=False)[0].prompt_ids == [5, 6, 1]


@pytest.mark.slow
def test_grpo_fit_with_a_rollout_func_from_yaml(tmp_path):
    """Two optimizer steps through the CLI: the function is picked by dotted path, its extra fields
    reach the reward function, and its log-probs (the policy's own) drive the importance-sampling
    correction with a sampler/trainer gap of float32 rounding only."""
    from grpo_lightning.cli import run_cli

    SEEN.clear()
    config = tmp_path / "cfg.yaml"
    config.write_text(f"""
trainer: {{accelerator: cpu, max_steps: 2, logger: false, enable_progress_bar: false, enable_checkpointing: false,
          default_root_dir: {tmp_path / "run"}}}
model: {{model: {make_model_dir(tmp_path / "m")}, learning_rate: 0.01, save_final_model: false,
        gradient_checkpointing: false}}
data:
  dataset: {write_prompts(tmp_path / "p.jsonl", num_rows=8)}
  reward_funcs: [tests.samplers.test_rollout_func.tag_reward]
  num_generations: 4
  per_device_train_batch_size: 8
  generation: {{max_completion_length: 6}}
  sampler:
    class_path: grpo_lightning.samplers.rollout_func.RolloutFuncSampler
    init_args: {{rollout_func: tests.samplers.test_rollout_func.policy_rollout, rollout_fields: [tag, source]}}
""")
    before = {n: p.detach().clone() for n, p in built(GRPOModule(str(tmp_path / "m"))).policy.named_parameters()}
    cli = run_cli(["fit", "--config", str(config)])
    assert cli.trainer.global_step == 2
    assert SEEN["tag"] == ["p0g0", "p0g1", "p0g2", "p0g3", "p1g0", "p1g1", "p1g2", "p1g3"] * 2
    assert SEEN["source"] == ["policy"] * 16
    metrics = cli.trainer.callback_metrics
    assert float(metrics["sampling/sampling_logp_difference/max"]) < 1e-4
    changed = [n for n, p in cli.model.policy.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert changed, "training must move the weights"
