"""Reward loading (names, dotted paths) and the TRL call convention (spec §5.2)."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo_lightning.rewards import (
    BUILTIN_REWARDS,
    RewardFunction,
    RewardRunner,
    RewardScores,
    resolve_reward_funcs,
)
from grpo_lightning.utils import async_loop

PROMPTS = ["1+1=", "1+1=", "2+2=", "2+2="]
COMPLETIONS = ["2", "3", "4", "44"]
IDS = [[10, 2], [11, 2], [12, 2], [12, 12]]


def length_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _score(funcs, weights=None, **extra):
    runner = RewardRunner(resolve_reward_funcs(funcs), weights)
    kw = dict(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=IDS, columns={})
    kw.update(extra)
    return runner.score(**kw)


def test_sync_reward_and_kwargs_received() -> None:
    seen = {}

    def spy(**kwargs):
        seen.update(kwargs)
        return [1.0, 0.0, 1.0, 0.0]

    state = object()
    out = _score(
        [spy],
        columns={"answer": ["2", "2", "4", "4"], "prompt": PROMPTS, "completion": COMPLETIONS},
        trainer_state=state,
    )
    assert isinstance(out, RewardScores) and out.names == ["spy"]
    assert out.rewards.dtype == torch.float32 and out.rewards.shape == (4, 1)
    assert out.rewards[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert set(seen) == {"prompts", "completions", "completion_ids", "trainer_state",
                         "log_extra", "log_metric", "answer"}  # fmt: skip
    assert seen["prompts"] == PROMPTS and seen["completions"] == COMPLETIONS
    assert seen["completion_ids"] == IDS and seen["answer"] == ["2", "2", "4", "4"]
    assert seen["trainer_state"] is state


def test_environments_passed_only_when_given() -> None:
    got = []

    def env_reward(prompts, environments=None, **kwargs):
        got.append(environments)
        return [0.0] * len(prompts)

    _score([env_reward])
    envs = ["e0", "e1", "e2", "e3"]
    _score([env_reward], environments=envs)
    assert got == [None, envs]


def test_log_metric_and_log_extra() -> None:
    def logging_reward(completions, log_metric, log_extra, **kwargs):
        log_metric("my_metric", 0.5)
        log_metric("my_metric", 1)
        log_extra("parsed", [c.upper() for c in completions])
        return [1.0] * len(completions)

    out = _score([logging_reward])
    assert out.logged_metrics == {"my_metric": [0.5, 1.0]}
    assert out.extra_columns == {"parsed": COMPLETIONS}


def test_none_is_nan_and_all_nan_row_warns(caplog: pytest.LogCaptureFixture) -> None:
    def r_none(completions, **kwargs):
        return [None, 1.0, None, 2]

    def r_none2(completions, **kwargs):
        return [None, None, 3.0, None]

    with caplog.at_level(logging.WARNING):
        out = _score([r_none, r_none2])
    assert math.isnan(out.rewards[0, 0]) and out.rewards[1, 0] == 1.0
    assert math.isnan(out.rewards[2, 0]) and out.rewards[2, 1] == 3.0
    assert "row 0" in caplog.text and "1 of 4 rows" in caplog.text


def test_accepted_return_types() -> None:
    def as_tensor(completions, **kw):
        return torch.tensor([1, 2, 3, 4])

    def as_numpy(completions, **kw):
        return np.array([0.5, 0.5, 0.5, 0.5])

    def as_tuple_mixed(completions, **kw):
        return (True, np.float32(2.5), torch.tensor(3.0), 7)

    out = _score([as_tensor, as_numpy, as_tuple_mixed])
    assert out.rewards.tolist() == [[1, 0.5, 1], [2, 0.5, 2.5], [3, 0.5, 3], [4, 0.5, 7]]


@pytest.mark.parametrize(
    "value, exc, pattern",
    [
        ([1.0, 2.0, 3.0], ValueError, r"reward function 'bad' returned 3 values for 4 completions"),
        (1.0, TypeError, r"'bad' returned float; it must return a list"),
        ("1234", TypeError, r"'bad' returned str"),
        ({"a": 1}, TypeError, r"'bad' returned dict"),
        ([1.0, "x", 0.0, 0.0], ValueError, r"'bad' returned 'x' \(str\) at index 1"),
        ([1.0, 0.0, [1.0], 0.0], ValueError, r"'bad' returned \[1.0\] \(list\) at index 2"),
        ([1.0, 0.0, 0.0, 1j], ValueError, r"at index 3"),
        (torch.ones(4, 1), ValueError, r"'bad' returned a tensor of shape \(4, 1\)"),
        (np.ones((2, 2)), ValueError, r"'bad' returned an array of shape \(2, 2\)"),
    ],
)
def test_bad_returns(value, exc, pattern) -> None:
    def bad(**kwargs):
        return value

    with pytest.raises(exc, match=pattern):
        _score([bad])


@pytest.mark.parametrize(
    "value",
    [float("nan"), float("inf"), -float("inf"), np.float32("nan"), torch.tensor(float("inf")), 1e39],
    ids=["nan", "inf", "-inf", "numpy-nan", "tensor-inf", "beyond-float32"],
)
def test_non_finite_reward_is_an_error_naming_function_row_and_value(value) -> None:
    def unbounded(completions, **kwargs):
        return [1.0, 0.0, value, 1.0]

    with pytest.raises(ValueError, match=r"reward function 'unbounded' returned .*(nan|inf|1e\+39).* for row 2") as err:
        _score([unbounded])
    assert "Return None (not NaN)" in str(err.value)


def test_non_finite_tensor_and_async_returns_are_errors_too() -> None:
    def as_tensor(completions, **kwargs):
        return torch.tensor([0.0, float("nan"), 0.0, 0.0])

    async def as_async(completions, **kwargs):
        return [0.0, 0.0, 0.0, float("-inf")]

    with pytest.raises(ValueError, match=r"'as_tensor' returned nan for row 1"):
        _score([as_tensor])
    with pytest.raises(ValueError, match=r"'as_async' returned -inf for row 3"):
        _score([as_async])


def test_huge_finite_rewards_are_accepted() -> None:
    out = _score([lambda completions, **kw: [1e30, -1e30, 3e38, 0.0]])
    assert out.rewards[:, 0].tolist() == pytest.approx([1e30, -1e30, 3e38, 0.0], rel=1e-6)


def test_bad_async_return_and_sync_returning_coroutine() -> None:
    async def bad_async(**kwargs):
        return [1.0]

    with pytest.raises(ValueError, match="'bad_async' returned 1 values for 4"):
        _score([bad_async])

    async def inner(**kwargs):
        return [0.0] * 4

    def sneaky(**kwargs):
        return inner(**kwargs)

    with pytest.raises(TypeError, match="'sneaky' returned an awaitable"):
        _score([sneaky])


def test_exception_in_reward_names_it() -> None:
    def broken(**kwargs):
        raise KeyError("solution")

    with pytest.raises(KeyError) as info:
        _score([broken])
    assert "reward function 'broken'" in "".join(getattr(info.value, "__notes__", []))


def test_async_and_mixed_order() -> None:
    calls = []

    def sync_a(completions, **kw):
        calls.append("sync_a")
        return [1.0] * 4

    async def async_b(completions, **kw):
        calls.append("async_b")
        await asyncio.sleep(0.01)
        return [2.0] * 4

    def sync_c(completions, **kw):
        calls.append("sync_c")
        return [3.0] * 4

    out = _score([sync_a, async_b, sync_c])
    assert out.names == ["sync_a", "async_b", "sync_c"]
    assert out.rewards[0].tolist() == [1.0, 2.0, 3.0]
    assert calls == ["sync_a", "sync_c", "async_b"]  # sync ones first, in list order


def test_async_rewards_run_concurrently() -> None:
    async def slow_a(completions, **kw):
        await asyncio.sleep(0.5)
        return [1.0] * len(completions)

    async def slow_b(completions, **kw):
        await asyncio.sleep(0.5)
        return [0.0] * len(completions)

    runner = RewardRunner(resolve_reward_funcs([slow_a, slow_b]))
    async_loop.get_loop()  # exclude the one-off thread start from the timing
    start = time.perf_counter()
    out = runner.score(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=IDS, columns={})
    assert time.perf_counter() - start < 0.9
    assert out.rewards[:, 0].tolist() == [1.0] * 4


def test_names_partial_and_callable_objects() -> None:
    class MyScorer:
        def __call__(self, completions, **kw):
            return [0.0] * len(completions)

    class MyAsyncScorer:
        async def __call__(self, completions, **kw):
            return [1.0] * len(completions)

    async def base_async(completions, scale=1.0, **kw):
        return [scale] * len(completions)

    funcs = resolve_reward_funcs(
        [functools.partial(functools.partial(length_reward), x=1), MyScorer(), MyAsyncScorer(),
         functools.partial(base_async, scale=2.0)]
    )  # fmt: skip
    assert [f.name for f in funcs] == ["length_reward", "MyScorer", "MyAsyncScorer", "base_async"]
    assert [f.is_async for f in funcs] == [False, False, True, True]
    out = RewardRunner(funcs).score(
        prompts=PROMPTS, completions=COMPLETIONS, completion_ids=IDS, columns={}
    )
    assert out.rewards[3].tolist() == [2.0, 0.0, 1.0, 2.0]


def test_dotted_path_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "my_rewards_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text(textwrap.dedent("""
        class Holder:
            @staticmethod
            def nested(completions, **kw):
                return [2.0] * len(completions)

        def correct(completions, answer, **kw):
            return [float(c == a) for c, a in zip(completions, answer)]

        NOT_CALLABLE = 3
    """))
    (pkg / "broken.py").write_text("import does_not_exist_anywhere_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    funcs = resolve_reward_funcs(
        ["my_rewards_pkg.scoring.correct", "my_rewards_pkg.scoring:Holder.nested"]
    )
    assert [f.name for f in funcs] == ["correct", "nested"]
    out = RewardRunner(funcs, [1.0, 0.5]).score(
        prompts=PROMPTS, completions=COMPLETIONS, completion_ids=IDS,
        columns={"answer": ["2", "2", "4", "4"]},
    )  # fmt: skip
    assert out.rewards[:, 0].tolist() == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        resolve_reward_funcs(["my_rewards_pkg.scoring.missing"])
    with pytest.raises(ValueError, match="not callable"):
        resolve_reward_funcs(["my_rewards_pkg.scoring.NOT_CALLABLE"])
    with pytest.raises(ValueError, match="cannot import 'nopkg_xyz.mod.fn'"):
        resolve_reward_funcs(["nopkg_xyz.mod.fn"])
    with pytest.raises(ValueError, match=r"^data\.reward_funcs\[1\]='nopkg_xyz\.mod\.fn': cannot import"):
        resolve_reward_funcs([lambda completions, **kwargs: [0.0] * len(completions), "nopkg_xyz.mod.fn"])
    with pytest.raises(ValueError, match=r"^data\.reward_funcs\[0\]: reward .* not callable"):
        resolve_reward_funcs(["my_rewards_pkg.scoring.NOT_CALLABLE"])
    with pytest.raises(ModuleNotFoundError, match="does_not_exist_anywhere_xyz"):
        resolve_reward_funcs(["my_rewards_pkg.broken.fn"])


def test_unknown_name_and_reward_model_strings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError) as info:
        resolve_reward_funcs(["no_such_reward"])
    msg = str(info.value)
    assert "exact_match_reward" in msg and "package.module.function" in msg and "org/name" in msg
    # A folder without a model: the loading error says which reward it came from.
    with pytest.raises(Exception, match="while loading reward model"):
        resolve_reward_funcs([str(tmp_path)])
    # A bare nn.Module has no tokenizer to fall back on.
    with pytest.raises(ValueError, match="has no tokenizer.*reward_processing_classes"):
        resolve_reward_funcs([torch.nn.Linear(2, 1)])
    # Strings with a '/' are reward models (Hub ids); never download in tests.
    seen = []

    class FakeRewardModel:
        def __init__(self, model, processing_class=None, **kwargs):
            seen.append((model, processing_class, kwargs))
            self.__name__ = model.split("/")[-1]

        def __call__(self, prompts, completions, **kwargs):
            return [0.0] * len(prompts)

    monkeypatch.setattr("grpo_lightning.rewards.loading.RewardModel", FakeRewardModel)
    (rf,) = resolve_reward_funcs(["org/some-reward-model"], "org/tok", trust_remote_code=True)
    assert rf.name == "some-reward-model" and not rf.is_async
    assert seen == [("org/some-reward-model", "org/tok",
                     {"model_init_kwargs": None, "trust_remote_code": True})]  # fmt: skip


def test_builtin_registry_is_lazy() -> None:
    assert "exact_match_reward" in BUILTIN_REWARDS
    try:
        import grpo_lightning.rewards.exact_match  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="not available"):
            resolve_reward_funcs(["exact_match_reward"])
    else:
        (func,) = resolve_reward_funcs(["exact_match_reward"])
        assert func.name == "exact_match_reward"


def test_single_item_and_passthrough() -> None:
    (rf,) = resolve_reward_funcs(length_reward)
    assert resolve_reward_funcs([rf]) == [rf]
    assert isinstance(rf, RewardFunction) and rf.name == "length_reward"


def test_weights() -> None:
    funcs = resolve_reward_funcs([length_reward, length_reward])
    assert RewardRunner(funcs).weights.tolist() == [1.0, 1.0]
    runner = RewardRunner(funcs, [0.5, 2])
    assert runner.weights.dtype == torch.float32 and runner.weights.tolist() == [0.5, 2.0]
    with pytest.raises(ValueError, match=r"data.reward_weights has 3 values .* 2 reward functions"):
        RewardRunner(funcs, [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="finite"):
        RewardRunner(funcs, [1.0, float("nan")])
    with pytest.raises(ValueError, match="data.reward_funcs"):
        RewardRunner([])


def test_input_validation() -> None:
    runner = RewardRunner(resolve_reward_funcs([length_reward]))
    with pytest.raises(ValueError, match="4 prompts but 3 completions"):
        runner.score(prompts=PROMPTS, completions=COMPLETIONS[:3], completion_ids=IDS, columns={})
    with pytest.raises(ValueError, match="column 'answer' has 1 values"):
        runner.score(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=IDS,
                     columns={"answer": ["x"]})  # fmt: skip
    with pytest.raises(ValueError, match="column 'trainer_state' clashes"):
        runner.score(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=IDS,
                     columns={"trainer_state": [0] * 4})  # fmt: skip


def test_async_loop_helpers() -> None:
    async def value(x, delay):
        await asyncio.sleep(delay)
        return x

    assert async_loop.gather([value(1, 0.02), value(2, 0.0)]) == [1, 2]
    assert async_loop.gather([]) == []

    async def fails():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        async_loop.run(fails())

    async def nested():
        coro = value(3, 0)
        async_loop.run(coro)

    with pytest.raises(RuntimeError, match="inside the background event loop"):
        async_loop.run(nested())
    async_loop.shutdown()
    assert async_loop.run(value(4, 0)) == 4  # restarts lazily
