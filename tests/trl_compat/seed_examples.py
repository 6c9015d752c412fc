"""The Python examples of the seed document (TRL's GRPO page), read from the document itself, and
how a test runs one: the import lines switched from ``trl`` to ``grpo_lightning``, hub ids and
datasets replaced by tiny offline ones, ``...`` placeholders filled in. Nothing else is changed.

``EXAMPLES`` lists every Python block of the seed by index, with what its test does (``run``: the
code runs, training where it trains; ``config``: built and checked as a config, ``train()`` not
run, with the reason) or the issue that brings it (``pending``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SEED_DOC = Path(os.environ.get("GRPO_SEED_DOC", REPO.parent / "shared/reference/seed/000_0c41d8174bca6920.txt"))
IMPORTS = (("from trl.rewards import", "from grpo_lightning.rewards import"), ("from trl import", "from grpo_lightning import"))


@dataclass(frozen=True)
class Example:
    """One seed block: what it shows, how the test treats it, and its literal substitutions."""

    title: str
    mode: str  # run | config | doctest | signature | same_as:<index> | pending:#<issue>
    substitutions: tuple[tuple[str, str], ...] = field(default=())
    why: str = ""


#: Hub ids and hub datasets, replaced wherever they occur by tiny offline stand-ins the test defines.
HUB = (('"Qwen/Qwen2.5-0.5B-Instruct"', "TINY_MODEL"), ('"Qwen/Qwen3-0.6B"', "TINY_MODEL"),
       ('"Qwen/Qwen2.5-72B"', "TINY_MODEL"), ('load_dataset("trl-lib/DeepMath-103K", split="train")', "TINY_MATH_DATASET"))
_REST = (("    ...,\n", "    **REST,\n"),)  # a call's "..." stands for the arguments shown elsewhere

EXAMPLES: dict[int, Example] = {
    0: Example("quick start", "run", ()),
    1: Example("vLLM colocate", "config", (("    ...,\n", "    **FAST,\n"),), "vLLM generation needs vLLM and a GPU"),
    2: Example("vLLM server", "config", (("       ...,\n", "       **FAST,\n"),), "needs a running vLLM server"),
    3: Example("continuous batching", "config", (("    ...,\n", "    **FAST,\n"),),
               "transformers' continuous batching is exercised by tests/samplers on its own"),
    4: Example("multi-node (DeepSpeed ZeRO-3 + vLLM server)", "config", (),
               "needs DeepSpeed, GPUs and a vLLM server"),
    5: Example("reward: longer completions (token count)", "run"),
    6: Example("reward 1 called by hand", "doctest"),
    7: Example("reward: longer completions (characters)", "run"),
    8: Example("reward 1.1 called by hand", "doctest"),
    9: Example("reward: format (conversational)", "run"),
    10: Example("reward 2 called by hand", "doctest"),
    11: Example("reward: accuracy against ground_truth", "run"),
    12: Example("reward 3 called by hand", "doctest"),
    13: Example("multi-task rewards", "run"),
    14: Example("async reward", "run"),
    15: Example("reward logging extra columns and metrics", "run"),
    16: Example("passing a reward function", "run", _REST),
    17: Example("sync and async reward functions together", "run", _REST),
    18: Example("static entropy bonus", "config", (("GRPOConfig(entropy_coef=0.05, ...)", "GRPOConfig(entropy_coef=0.05, **FAST)"),),
                "a config line; the bonus itself is tested in tests/module"),
    19: Example("adaptive entropy", "config", (("    ...\n)", "    **FAST,\n)"),),
                "a config; AdaptiveEntropy is tested in tests/callbacks"),
    20: Example("tools argument", "run", _REST),
    21: Example("tools: multiply / async_add", "run", _REST),
    22: Example("environment that makes its prompts", "run"),
    23: Example("environment fed by a dataset", "run", ((
        "    def increment(self, step: int) -> int:  # exposed as a tool (see the full docstring above)\n",
        "    def increment(self, step: int) -> int:  # exposed as a tool (see the full docstring above)\n"
        '        """\n        Increment the internal counter.\n\n        Args:\n            step: Value to add to the counter.'
        '\n\n        Returns:\n            The updated counter value.\n        """\n'),),
        "the block points to the docstring of the block above for its tool; it is copied in"),
    24: Example("environment reward plus a reward function", "run",
                (("    ...\n", "    return [float(len(c[-1]['content'])) for c in completions]\n"),)),
    25: Example("several environments", "run", (('["coding", "game"] * 500', '["coding", "game"] * 4'),),
                "a routing dataset with only the environment column: each reset() makes the prompt"),
    26: Example("multimodal tool result", "run", (('Image.open("screenshot.png")', "Image.open(SCREENSHOT)"),),
                "the tool is defined and called through our tools layer; its image reaching a VLM's next turn is "
                "tests/agents/test_tool_images.py"),
    27: Example("GRPOTrainer signature", "signature"),
    28: Example("GRPOTrainer docstring example", "same_as:0"),
    29: Example("train() signature", "signature"),
    30: Example("save_model() signature", "signature"),
    31: Example("push_to_hub() signature", "signature"),
    32: Example("GRPOConfig signature", "signature", why="tests/trl_compat/test_config.py checks every field"),
}


def split_top_level(text: str) -> list[str]:
    """``text`` split on the commas outside brackets (a signature's parameters).

    >>> split_top_level("a: int = 1, b: dict = {'x': 1, 'y': 2}, c=f(1, 2)")
    ['a: int = 1', " b: dict = {'x': 1, 'y': 2}", ' c=f(1, 2)']
    """
    parts, depth, current = [], 0, ""
    for ch in text:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return parts


def seed_blocks() -> list[str]:
    if not SEED_DOC.is_file():
        pytest.skip(f"the seed document is not at {SEED_DOC}: set GRPO_SEED_DOC to its path")
    return re.findall(r"```python\n(.*?)```", SEED_DOC.read_text(), re.S)


def dedent_block(code: str) -> str:
    """A block indented inside a list item (the vLLM server one) at column 0."""
    lines = code.splitlines()
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return "\n".join(line[indent:] for line in lines) + "\n"


def adapted(index: int) -> str:
    """Block ``index`` as its test runs it (imports switched, substitutions applied)."""
    code = seed_blocks()[index]
    for old, new in EXAMPLES[index].substitutions:
        assert old in code, f"seed block {index}: {old!r} not found (the document changed?)"
        code = code.replace(old, new)
    for old, new in (*HUB, *IMPORTS):
        code = code.replace(old, new)
    assert "trl" not in re.sub(r"#.*", "", code).replace("grpo_lightning", ""), code
    return dedent_block(code)
