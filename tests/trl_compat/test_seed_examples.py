"""Item 5 of #14: every Python example of the seed (TRL's GRPO page), read from the document, runs
with ``from grpo_lightning import ...`` in place of ``from trl import ...``.

The examples' code is unchanged except for the import lines and the literal substitutions listed in
``seed_examples.EXAMPLES`` (hub ids -> a tiny local model, hub datasets -> tiny in-memory ones,
``...`` -> the arguments shown elsewhere on the page). To keep each run to one optimizer step the
fixture ``short_runs`` patches how ``GRPOConfig`` resolves: ``max_steps=1``,
``max_completion_length=8``, no checkpoints, output in a temporary folder.
"""

from __future__ import annotations

import ast
import doctest
import inspect
import re
import sys

import pytest
import yaml

from grpo_lightning import GRPOConfig, GRPOTrainer, config_to_yaml
from grpo_lightning.trl_compat import config as config_module
from tests.trl_compat.seed_examples import EXAMPLES, adapted, seed_blocks, split_top_level


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, shared_assets):
    """A 2-layer Llama over every printable character, with Qwen2.5's chat template (tools render
    as Qwen's do, and the tool-call parser is detected from it, as for the seed's models)."""
    from transformers import AutoTokenizer

    from grpo_lightning.utils.tiny_models import build_char_tokenizer, build_tiny_causal_lm

    path = tmp_path_factory.mktemp("seed_model")
    template = AutoTokenizer.from_pretrained(shared_assets / "tokenizers" / "qwen2.5").chat_template
    tokenizer = build_char_tokenizer()
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = template  # Qwen's turns end with <|im_end|>: one token, the EOS
    build_tiny_causal_lm(len(tokenizer), max_position_embeddings=4096).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture()
def short_runs(monkeypatch, tmp_path):
    resolve = config_module.GRPOConfig.__post_init__

    def short(self):
        self.max_steps, self.max_completion_length, self.save_strategy = 1, 8, "no"
        self.output_dir, self.logging_steps = str(tmp_path / "out"), 1
        resolve(self)

    monkeypatch.setattr(config_module.GRPOConfig, "__post_init__", short)
    monkeypatch.chdir(tmp_path)


def conversational(rows):
    import datasets

    return datasets.Dataset.from_list([{**row, "prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows])


def math_rows(n=8):
    return [{"prompt": f"What is {i}+{i + 1}?", "solution": f"${2 * i + 1}$", "ground_truth": str(2 * i + 1)}
            for i in range(n)]


def run_example(index: int, **names):
    """Execute seed block ``index`` (adapted) as a script; its namespace."""
    namespace = {"__name__": "__main__", **names}
    exec(compile(adapted(index), f"<seed example {index}: {EXAMPLES[index].title}>", "exec"), namespace)
    return namespace


def logged(trainer) -> dict:
    steps = [e for e in trainer.log_history if "loss" in e]
    assert steps and trainer.lightning_trainer.global_step == 1
    return steps[-1]


def test_every_python_block_of_the_seed_is_listed():
    blocks = seed_blocks()
    assert len(blocks) == 33 and sorted(EXAMPLES) == list(range(33))
    for index, example in EXAMPLES.items():
        if example.mode.startswith("pending:"):
            assert re.fullmatch(r"pending:#\d+", example.mode) and example.why, index


# ---------------------------------------------------------------------------- trained examples
@pytest.mark.slow
def test_quick_start(tiny_model, short_runs):
    pytest.importorskip("math_verify", reason="accuracy_reward needs the [math] extra (math-verify)")
    ns = run_example(0, TINY_MODEL=tiny_model, TINY_MATH_DATASET=conversational(math_rows()))
    step = logged(ns["trainer"])
    assert "rewards/accuracy_reward/mean" in step
    assert ns["trainer"].args.output_dir.endswith("out")


@pytest.mark.slow
def test_reward_function_examples_train_together(tiny_model, short_runs):
    import datasets

    funcs = [run_example(5)["reward_func"], run_example(7)["reward_func"], run_example(11)["reward_func"],
             run_example(14)["async_reward_func"], run_example(15)["reward_func"]]
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=funcs, args=GRPOConfig(),
                          train_dataset=datasets.Dataset.from_list(math_rows()))
    trainer.train()
    step = logged(trainer)
    # block 5 scores token counts, block 7 characters (one id per character here): equal rewards
    assert step["rewards/reward_func/mean"] >= 0 and step["rewards/async_reward_func/mean"] == 1.0
    assert "accuracy" in step  # block 15's log_metric
    format_func = run_example(9)["format_reward_func"]  # conversational completions
    trainer = GRPOTrainer(model=tiny_model, reward_funcs=format_func, args=GRPOConfig(),
                          train_dataset=conversational(math_rows()))
    trainer.train()
    assert logged(trainer)["rewards/format_reward_func/mean"] == 0.0  # a random model writes no <think> tags


@pytest.mark.parametrize("index, function_block", [(6, 5), (8, 7), (10, 9), (12, 11)])
def test_reward_functions_called_by_hand(index, function_block):
    namespace = run_example(function_block)
    test = doctest.DocTestParser().get_doctest(seed_blocks()[index], namespace, f"seed {index}", None, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    assert runner.failures == 0 and runner.tries >= 1


@pytest.mark.slow
def test_multi_task_rewards(tiny_model, short_runs):
    def check_math_solution(prompt, completion):
        return str(eval(prompt.removeprefix("What is ").removesuffix("?"))) in completion

    def test_code_solution(prompt, completion):
        return "def " in completion

    ns = run_example(13, TINY_MODEL=tiny_model, check_math_solution=check_math_solution,
                     test_code_solution=test_code_solution)
    step = logged(ns["trainer"])
    # one prompt per step (8 completions = per_device_train_batch_size): one of the two functions applies
    assert {step["rewards/math_reward_func/frac_none"], step["rewards/coding_reward_func/frac_none"]} == {0.0, 1.0}


@pytest.mark.slow
def test_passing_reward_functions(tiny_model, short_runs):
    import datasets

    dataset = datasets.Dataset.from_list(math_rows())
    rewards = run_example(15)
    ns16 = run_example(16, reward_func=rewards["reward_func"], REST={"model": tiny_model, "train_dataset": dataset})
    assert ns16["trainer"].config["data"]["reward_funcs"][0].value is rewards["reward_func"]  # trains as 17 does

    async def async_reward_func1(completions, **kwargs):
        return [1.0] * len(completions)

    async def async_reward_func2(completions, **kwargs):
        return [2.0] * len(completions)

    ns = run_example(17, reward_func=rewards["reward_func"], async_reward_func1=async_reward_func1,
                     async_reward_func2=async_reward_func2, REST={"model": tiny_model, "train_dataset": dataset})
    ns["trainer"].train()
    step = logged(ns["trainer"])
    assert step["rewards/async_reward_func1/mean"] == 1.0 and step["rewards/async_reward_func2/mean"] == 2.0
    assert step["reward"] == pytest.approx(step["rewards/reward_func/mean"] + 3.0)


@pytest.mark.slow
def test_tools(tiny_model, short_runs):
    from tests.trl_compat.rewards import length_reward

    rest = {"model": tiny_model, "train_dataset": conversational(math_rows()), "reward_funcs": length_reward}
    ns = run_example(21, REST=rest)
    assert ns["trainer"].config["data"]["agent"]["tools"][0].value is ns["multiply"]
    ns["trainer"].train()
    step = logged(ns["trainer"])
    assert "tools/call_frequency" in step

    def tool1(x: int) -> int:
        """Doubles x.

        Args:
            x: A number.

        Returns:
            Twice x.
        """
        return 2 * x

    ns20 = run_example(20, tool1=tool1, tool2=ns["multiply"], REST=rest)
    assert [t.value for t in ns20["trainer"].config["data"]["agent"]["tools"]] == [tool1, ns["multiply"]]


@pytest.mark.slow
def test_environments(tiny_model, short_runs):
    ns = run_example(22, TINY_MODEL=tiny_model)  # no dataset: reset() makes each prompt
    assert "rewards/IncrementEnv/mean" in logged(ns["trainer"])
    ns23 = run_example(23, TINY_MODEL=tiny_model)  # the dataset's target column reaches reset(target=...)
    assert "rewards/IncrementEnv/mean" in logged(ns23["trainer"])
    ns24 = run_example(24, TINY_MODEL=tiny_model, IncrementEnv=ns["IncrementEnv"], GRPOConfig=GRPOConfig,
                       GRPOTrainer=GRPOTrainer)  # a fragment: the names come from the blocks above it
    ns24["trainer"].train()
    step = logged(ns24["trainer"])
    assert step["reward"] == pytest.approx(step["rewards/format_reward/mean"] + step["rewards/IncrementEnv/mean"])


@pytest.mark.slow
def test_several_environments(tiny_model, short_runs):
    def reward_func(completions, environments, **kwargs):
        return [float(type(env).__name__ == "CodingEnv") for env in environments]

    ns = run_example(25, TINY_MODEL=tiny_model, reward_func=reward_func)
    assert "rewards/reward_func/mean" in logged(ns["trainer"])


def test_multimodal_tool_result(tmp_path):
    """The seed's ``take_screenshot`` as given: its schema is read from its docstring, and a call
    returns its content blocks (the image object itself, then the text) as the tool message."""
    from PIL import Image

    from grpo_lightning.tools import ToolCall, Toolbox, execute_calls

    Image.new("RGB", (8, 8), "red").save(tmp_path / "screenshot.png")
    take_screenshot = run_example(26, SCREENSHOT=str(tmp_path / "screenshot.png"))["take_screenshot"]
    tools = Toolbox.of([take_screenshot])
    assert tools.schemas[0]["function"]["name"] == "take_screenshot"
    ((result,),) = execute_calls([[ToolCall("take_screenshot", {})]], [tools])
    assert not result.failed and [block["type"] for block in result.content] == ["image", "text"]
    assert result.content[0]["image"].size == (8, 8) and result.content[1]["text"] == "Here is the screenshot."


# ---------------------------------------------------------------------------- config-level examples
@pytest.mark.parametrize("index, key, expected", [
    (1, ("data", "sampler", "class_path"), "grpo_lightning.samplers.vllm_colocate.VLLMColocateSampler"),
    (2, ("data", "sampler", "class_path"), "grpo_lightning.samplers.vllm_server.VLLMServerSampler"),
    (3, ("data", "sampler", "init_args", "continuous_batching_config"), {"use_cuda_graph": False,
                                                                          "max_memory_percent": 0.4}),
    (18, ("model", "entropy_coef"), 0.05),
    (19, ("trainer", "callbacks", 0), {"class_path": "grpo_lightning.callbacks.AdaptiveEntropy", "init_args": {
        "entropy_target": 5.0, "entropy_coef_delta": 0.005, "entropy_coef_min": 0.0, "entropy_coef_max": 1.0}}),
])
def test_config_examples(index, key, expected, tmp_path):
    # block 19 continues block 18, which imported GRPOConfig
    args = run_example(index, FAST={"output_dir": str(tmp_path)}, GRPOConfig=GRPOConfig)["training_args"]
    value = yaml.safe_load(config_to_yaml(args))
    for part in key:
        value = value[part]
    assert value == expected, EXAMPLES[index].why


def test_multi_node_script(tiny_model, short_runs, monkeypatch):
    built = []
    monkeypatch.setattr(GRPOTrainer, "train", lambda self, *a, **k: built.append(self))
    monkeypatch.setattr(sys, "argv", ["train_grpo.py", "--vllm_server_host", "ip-10-0-0-7"])
    monkeypatch.setenv("WORLD_SIZE", "32")  # 4 nodes x 8 GPUs (4 prompts per GPU need 32 ranks for groups of 8)
    run_example(4, TINY_MODEL=tiny_model, TINY_MATH_DATASET=conversational(math_rows()))  # runs main()
    (trainer,) = built
    config = yaml.safe_load(trainer.to_yaml())
    assert config["data"]["sampler"]["init_args"]["host"] == "10.0.0.7"
    assert config["data"]["per_device_train_batch_size"] == 4
    assert config["trainer"]["strategy"]["init_args"]["config"] == "examples/deepspeed_configs/zero3.json"
    assert config["data"]["reward_funcs"] == ["grpo_lightning.rewards.accuracy.accuracy_reward"]


# ---------------------------------------------------------------------------- signatures
def _seed_parameters(index: int) -> list[str]:
    text = seed_blocks()[index].strip()
    names = split_top_level(text[text.index("(") + 1: text.rindex(")")])
    return [n.split(":")[0].split("=")[0].strip() for n in names if n.strip()]


# Parameters of the installed transformers' methods that the seed's signatures do not list:
# Trainer.push_to_hub(..., private=None, **kwargs), which a caller's private=True must reach.
NOT_IN_SEED_SIGNATURE = {"push_to_hub": ["private"]}


@pytest.mark.parametrize("index, function", [(27, GRPOTrainer.__init__), (29, GRPOTrainer.train),
                                             (30, GRPOTrainer.save_model), (31, GRPOTrainer.push_to_hub)])
def test_signatures_match_the_seed(index, function):
    ours = [name if p.kind != p.VAR_KEYWORD else f"**{name}"
            for name, p in inspect.signature(function).parameters.items() if name != "self"]
    seed = _seed_parameters(index)
    extra = NOT_IN_SEED_SIGNATURE.get(function.__name__, [])
    assert set(extra) <= set(ours)
    assert [n for n in ours if (not n.startswith("**") or n in seed) and n not in extra] == seed


def test_docstring_example_is_the_quick_start():
    blocks = seed_blocks()
    doc = "\n".join(line[4:] for line in blocks[28].splitlines() if line.startswith((">>> ", "... ")))
    dump = lambda code: sorted(ast.dump(stmt) for stmt in ast.parse(code).body)  # noqa: E731
    assert dump(doc) == dump(blocks[0])
