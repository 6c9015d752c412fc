"""Built-in rewards: registry, format and length rewards, and real-data checks (GSM8K, MATH-500,
Countdown) from the shared assets."""

from __future__ import annotations

import importlib
import itertools
import json
import re
import sys
import threading
from fractions import Fraction
from pathlib import Path

import pytest

import grpo_lightning.rewards as rewards_pkg
from grpo_lightning.rewards import (
    BUILTIN_REWARDS,
    RewardRunner,
    import_dotted_path,
    resolve_reward_funcs,
)
from grpo_lightning.rewards.countdown import countdown_reward, evaluate_expression
from grpo_lightning.rewards.format import RegexFormatReward, think_format_reward
from grpo_lightning.rewards.gsm8k import gold_answer, gsm8k_answer_reward
from grpo_lightning.rewards.length import (
    RepetitionPenalty,
    SoftOverlongPunishment,
    get_soft_overlong_punishment,
)


def _rows(root: Path, rel: str) -> list[dict]:
    with open(root / "datasets" / rel) as f:
        return [json.loads(line) for line in f]


# ----------------------------------------------------------------------------- registry
def test_registry_entries_import_and_resolve_by_name() -> None:
    needs_args = {"regex_format_reward", "soft_overlong_punishment", "cosine_scaled_reward"}
    for name, path in BUILTIN_REWARDS.items():
        assert callable(import_dotted_path(path)), name
        if name in needs_args:
            with pytest.raises(ValueError, match=r"(?s)needs arguments.*class_path: grpo_lightning"):
                resolve_reward_funcs([name])
        else:
            (rf,) = resolve_reward_funcs([name])
            assert rf.name == name and not rf.is_async
    for name in rewards_pkg._LAZY:  # importable from grpo_lightning.rewards
        assert callable(getattr(rewards_pkg, name)), name
    with pytest.raises(AttributeError):
        rewards_pkg.no_such_reward  # noqa: B018


def test_class_configured_from_yaml_with_class_path() -> None:
    jsonargparse = pytest.importorskip("jsonargparse")
    from typing import Callable

    parser = jsonargparse.ArgumentParser()
    parser.add_argument("--funcs", type=list[Callable | str])
    cfg = parser.parse_object({"funcs": [
        "think_format_reward",
        {"class_path": "grpo_lightning.rewards.SoftOverlongPunishment",
         "init_args": {"max_completion_len": 10, "soft_punish_cache": 4}},
        {"class_path": "grpo_lightning.rewards.RegexFormatReward",
         "init_args": {"pattern": r"^\d+$", "flags": "MULTILINE|IGNORECASE", "name": "digits"}},
    ]})  # fmt: skip
    funcs = resolve_reward_funcs(parser.instantiate(cfg).funcs)
    assert [f.name for f in funcs] == [
        "think_format_reward", "soft_overlong_punishment_reward", "digits"
    ]
    out = RewardRunner(funcs).score(
        prompts=["p", "p"], completions=["<think>a</think>1", "12"], completion_ids=[[1] * 8, [1] * 10]
    )
    assert out.rewards.tolist() == [[1.0, -0.5, 0.0], [0.0, -1.0, 1.0]]


# ----------------------------------------------------------------------------- format / length
THINK_CASES = [
    "<think>\nreasoning\n</think>\nanswer", "<think>r</think>", "<think>r", " <think>r</think>",
    "<think>a<think>b</think>c", "answer <think>r</think>", "<think>\n\n</think>\n\n42\n",
    "x\n<think>r</think>",
]  # fmt: skip


def test_think_format_reward() -> None:
    # re.match anchors at the start even with MULTILINE: text before <think> fails.
    assert think_format_reward(THINK_CASES) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    assert think_format_reward([[{"role": "assistant", "content": THINK_CASES[0]}]]) == [1.0]


def test_regex_format_reward_modes_flags_and_errors() -> None:
    text = ["<answer>12</answer>", "x <answer>12</answer>", "<ANSWER>12</ANSWER>"]
    assert RegexFormatReward(r"<answer>\d+</answer>")(text) == [1.0, 0.0, 0.0]
    assert RegexFormatReward(r"<answer>\d+</answer>", mode="search")(text) == [1.0, 1.0, 0.0]
    assert RegexFormatReward(r"<answer>\d+</answer>", flags=["IGNORECASE"])(text) == [1.0, 0.0, 1.0]
    assert RegexFormatReward(r"<answer>\d+", mode="fullmatch")(text) == [0.0, 0.0, 0.0]
    assert RegexFormatReward("a.b", flags=0)(["a\nb"]) == [0.0]
    assert RegexFormatReward("a.b")(["a\nb"]) == [1.0]  # DOTALL by default
    assert RegexFormatReward("x", reward=0.5, penalty=-1)(["x", "y"]) == [0.5, -1.0]
    assert resolve_reward_funcs([RegexFormatReward("x", name="my_fmt")])[0].name == "my_fmt"
    with pytest.raises(ValueError, match="unknown regex flag 'DOTAL'"):
        RegexFormatReward("x", flags="DOTAL")
    with pytest.raises(ValueError, match="invalid pattern"):
        RegexFormatReward("(")
    with pytest.raises(ValueError, match="mode="):
        RegexFormatReward("x", mode="find")  # type: ignore[arg-type]


def test_soft_overlong_punishment_formula() -> None:
    reward = get_soft_overlong_punishment(max_completion_len=100, soft_punish_cache=20)
    assert isinstance(reward, SoftOverlongPunishment)
    lengths = [0, 80, 81, 90, 99, 100, 101, 500]
    expected = [0.0, 0.0, -1 / 20, -0.5, -19 / 20, -1.0, -1.0, -1.0]
    assert reward(completion_ids=[[7] * n for n in lengths]) == pytest.approx(expected)
    assert SoftOverlongPunishment(10, 0)(completion_ids=[[1] * 10, [1] * 11]) == [0.0, -1.0]
    with pytest.raises(ValueError, match="soft_punish_cache"):
        SoftOverlongPunishment(10, 11)
    with pytest.raises(ValueError, match="max_completion_len"):
        SoftOverlongPunishment(0, 0)


def test_repetition_penalty() -> None:
    assert RepetitionPenalty(3)(completion_ids=[[1, 2, 3, 1, 2, 3], [1, 2]]) == [-0.25, 0.0]
    with pytest.raises(ValueError, match="max_penalty"):
        RepetitionPenalty(3, 0.5)


@pytest.mark.trl
def test_matches_trl_reference_rewards() -> None:
    trl_rewards = pytest.importorskip("trl.rewards")
    pytest.importorskip("math_verify")
    from grpo_lightning.rewards.accuracy import accuracy_reward, get_cosine_scaled_reward

    msgs = [[{"role": "assistant", "content": c}] for c in THINK_CASES]
    assert think_format_reward(msgs) == trl_rewards.think_format_reward(msgs)
    ids = [[1] * n for n in (0, 50, 85, 100, 130)]
    assert SoftOverlongPunishment(100, 30)(ids) == trl_rewards.get_soft_overlong_punishment(100, 30)(ids)
    ids = [[1, 2, 1, 2, 1], [3, 3, 3], [1], [4, 5, 6, 7]]
    assert RepetitionPenalty(2, -0.5)(ids) == trl_rewards.get_repetition_penalty_reward(2, -0.5)(ids)
    sols = [r"$\frac{1}{3}$", r"$\frac{1}{3}$", "no math", r"The answer is $\boxed{4}$"]
    comps = [[{"role": "assistant", "content": c}] for c in
             [r"\boxed{\frac{1}{3}}", r"\boxed{0.5}", r"\boxed{1}", r"so \boxed{4} kg"]]  # fmt: skip
    assert accuracy_reward(comps, sols) == trl_rewards.accuracy_reward(comps, sols)
    ids = [[1] * 30, [1] * 70, [1], [1] * 200]
    ours = get_cosine_scaled_reward(100)(comps, sols, ids)
    assert ours == trl_rewards.get_cosine_scaled_reward(100)(comps, sols, ids)


# ----------------------------------------------------------------------------- accuracy (math)
MALFORMED_SHORTHAND = re.compile(r"\\(?:d?frac|sqrt)(?:\s*\d|\{[^{}]*\}\s*\d)")  # \frac43, \sqrt2


@pytest.mark.parametrize("gold_from", ["answer", "solution"])
def test_accuracy_reward_on_math500(shared_assets: Path, gold_from: str) -> None:
    pytest.importorskip("math_verify")
    from grpo_lightning.rewards.accuracy import accuracy_reward

    rows = _rows(shared_assets, "math500/test.jsonl")
    golds = [f"${r['answer']}$" if gold_from == "answer" else r["solution"] for r in rows]
    right = [f"The final answer is $\\boxed{{{r['answer']}}}$." for r in rows]
    logged: dict[str, list] = {}
    scores = accuracy_reward(right, golds, log_extra=lambda k, v: logged.setdefault(k, []).extend(v))
    assert None not in scores  # every MATH-500 gold answer parses
    assert set(logged) == {"solution", "gold_parsed", "answer_parsed"}
    assert all(len(v) == len(rows) for v in logged.values())
    # TRL's answer config does not repair shorthand LaTeX such as \frac43 (8 of 500 answers).
    checked = [s for s, r in zip(scores, rows) if not MALFORMED_SHORTHAND.search(r["answer"])]
    assert len(checked) >= 480 and checked == [1.0] * len(checked)
    wrong = accuracy_reward([r"So it is \boxed{-98765}."] * len(rows), golds)
    assert wrong == [0.0] * len(rows)


def test_reasoning_accuracy_reward_and_other_threads() -> None:
    pytest.importorskip("math_verify")
    from grpo_lightning.rewards.accuracy import accuracy_reward, reasoning_accuracy_reward

    comps = [r"<think>\boxed{2}</think>so \boxed{3}", r"<think>\boxed{3}", r"<end>\boxed{3}"]
    assert reasoning_accuracy_reward(comps, ["$3$"] * 3) == [1.0, 0.0, 0.0]
    assert reasoning_accuracy_reward(comps, ["$3$"] * 3, ["<end>", "</think>"]) == [1.0, 0.0, 1.0]
    # Off the main thread math_verify's signal-based timeouts are disabled instead of failing.
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=accuracy_reward([r"\boxed{3}"], ["$3$"])))
    thread.start()
    thread.join()
    assert result["r"] == [1.0]


def test_accuracy_reward_without_math_verify(monkeypatch: pytest.MonkeyPatch) -> None:
    module = importlib.import_module("grpo_lightning.rewards.accuracy")
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ImportError, match=r"pip install 'grpo-lightning\[math\]'"):
        module.accuracy_reward([r"\boxed{1}"], ["$1$"])


# ----------------------------------------------------------------------------- GSM8K
def test_gsm8k_answer_reward_on_real_rows(shared_assets: Path) -> None:
    rows = _rows(shared_assets, "gsm8k/test.jsonl")
    golds = [r["answer"] for r in rows]
    assert all(gold_answer(g) is not None for g in golds)
    finals = [g.split("####")[-1].strip() for g in golds]
    assert gsm8k_answer_reward(golds, golds) == [1.0] * len(rows)  # the worked solution itself
    right = [f"Let me think.\nThe answer is {f}." for f in finals]
    assert gsm8k_answer_reward(right, golds) == [1.0] * len(rows)
    chat = [[{"role": "assistant", "content": f"So {f}"}] for f in finals]
    assert gsm8k_answer_reward(chat, golds) == [1.0] * len(rows)
    wrong = [f"The answer is {gold_answer(g) + 1:g}" for g in golds]
    assert gsm8k_answer_reward(wrong, golds) == [0.0] * len(rows)
    assert gsm8k_answer_reward(["I do not know"], golds[:1]) == [0.0]


# ----------------------------------------------------------------------------- Countdown
def _solve(numbers: list[int], target: int) -> str | None:
    """Brute force over orders, operators and both bracketings of three or four numbers."""
    for perm in itertools.permutations(numbers):
        for ops in itertools.product("+-*/", repeat=len(perm) - 1):
            terms = [str(n) for n in perm]
            candidates = [f"({terms[0]} {ops[0]} {terms[1]}) {ops[1]} {terms[2]}",
                          f"{terms[0]} {ops[0]} ({terms[1]} {ops[1]} {terms[2]})"]  # fmt: skip
            for expr in candidates:
                if evaluate_expression(expr, numbers) == target:
                    return expr
    return None


def test_countdown_reward_on_real_rows(shared_assets: Path) -> None:
    rows = _rows(shared_assets, "countdown/countdown_cd3_test.jsonl")
    inputs, outputs = [r["input"] for r in rows], [r["output"] for r in rows]
    solutions = [_solve([int(x) for x in r["input"].split(",")], int(r["output"])) for r in rows]
    assert None not in solutions  # all 256 rows are solvable
    tagged = [f"<think>try</think>\n<answer>{s}</answer>" for s in solutions]
    assert countdown_reward(tagged, inputs, outputs) == [1.0] * len(rows)
    last_line = [f"I found it.\n{s} = {o}" for s, o in zip(solutions, outputs)]
    assert countdown_reward(last_line, inputs, outputs) == [1.0] * len(rows)
    # An earlier wrong answer tag does not count; the last one does.
    two_tags = [f"<answer>{s}</answer> no wait <answer>1+1</answer>" for s in solutions]
    assert countdown_reward(two_tags, inputs, outputs) == [0.0] * len(rows)
    wrong_target = [str(int(o) + 1) for o in outputs]
    assert countdown_reward(tagged, inputs, wrong_target) == [0.0] * len(rows)
    dropped = [f"<answer>{s.rsplit(' ', 2)[0].strip('()')}</answer>" for s in solutions]
    assert countdown_reward(dropped, inputs, outputs) == [0.0] * len(rows)
    doubled = [f"<answer>{s} + {i.split(',')[0]} - {i.split(',')[0]}</answer>"
               for s, i in zip(solutions, inputs)]  # fmt: skip
    assert countdown_reward(doubled, inputs, outputs) == [0.0] * len(rows)


@pytest.mark.parametrize(
    "expression, value",
    [
        ("30 - (100 - 93)", Fraction(23)),
        ("(30 × 100) ÷ 93", Fraction(3000, 93)),
        (r"30 \times 100 - 93", Fraction(2907)),
        ("-30 + 100 - 93", Fraction(-23)),
        ("30 - (100 - 93) = 23", Fraction(23)),
        ("30 - (100 - 93) = 24", None),  # a false statement
        ("30 / (100 - 100) + 93", None),  # wrong numbers anyway
        ("30 * 100 ** 93", None),
        ("30 // 100 + 93", None),
        ("30.0 + 100 + 93", None),
        ("__import__('os').system('true') + 30 + 100 + 93", None),
        ("abs(30) + 100 + 93", None),
        ("30 + 100 + 93 + 30", None),
        ("(" * 200 + "30 + 100 + 93" + ")" * 200, None),  # too long
        ("", None),
    ],
)
def test_evaluate_expression_is_safe(expression: str, value: Fraction | None) -> None:
    assert evaluate_expression(expression, [30, 100, 93]) == value


def test_countdown_reward_edge_cases() -> None:
    assert evaluate_expression("5 / (3 - 3)", [5, 3, 3]) is None  # division by zero
    assert countdown_reward(["<answer>5 / (3 - 3)</answer>"], ["5,3,3"], ["1"]) == [0.0]
    assert countdown_reward(["<answer>5 * 3 - 3</answer>"], [[5, 3, 3]], [12]) == [1.0]
    assert countdown_reward(["<answer>6 / 4 * 2</answer>"], ["6,4,2"], ["3"]) == [1.0]  # exact
    chat = [[{"role": "assistant", "content": "<answer>(6 + 4) / 2</answer>"}]]
    assert countdown_reward(chat, ["6,4,2"], ["5"]) == [1.0]
    assert countdown_reward(["1 + 2", "1 + 2"], ["x,y", "1,2"], ["3", "three"]) == [None, None]
    assert countdown_reward(["no answer at all", ""], ["1,2"] * 2, ["3"] * 2) == [0.0, 0.0]
