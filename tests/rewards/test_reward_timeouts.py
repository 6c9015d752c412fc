"""Reward time limits (``data.reward_timeout_s``): a late call scores None instead of stalling.

Each slow reward sleeps 5 s against a 0.2 s limit; the wall-time bound (2 s) leaves a wide margin
for a loaded machine while staying far below the sleep.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time

import pytest
import torch

from grpo_lightning.rewards import RewardModel, RewardRunner, resolve_reward_funcs
from grpo_lightning.rewards.timeouts import async_deadline, gathered_timeout_metrics, resolve_timeouts
from grpo_lightning.utils import async_loop
from grpo_lightning.utils.tiny_models import build_char_tokenizer
from tests.data.fake_ranks import ThreadRanks, make_builder

PROMPTS = ["1+1=", "1+1=", "2+2=", "2+2="]
COMPLETIONS = ["2", "3", "4", "44"]
IDS = [[10, 2], [11, 2], [12, 2], [12, 12]]
SLEEP_S, LIMIT_S, BOUND_S = 5.0, 0.2, 2.0


@pytest.fixture(scope="module", autouse=True)
def late_calls_finish_here():
    """The late calls' threads end within this module: one finishing later would log its "finished
    late" line into whichever test runs then, after pytest closed the stream it captured."""
    yield
    for thread in threading.enumerate():
        if thread.name.startswith("grpo-reward-"):
            thread.join(timeout=2 * SLEEP_S)


def slow_sync(completions, log_metric, log_extra, **kwargs):
    log_metric("late_metric", 1.0)  # pushed before the limit: must not reach the results
    log_extra("late_column", list(completions))
    time.sleep(SLEEP_S)
    return [1.0] * len(completions)


async def slow_async(completions, **kwargs):
    await asyncio.sleep(SLEEP_S)
    return [1.0] * len(completions)


def length_reward(completions, log_metric, **kwargs):
    log_metric("on_time_metric", 2.0)
    return [float(len(c)) for c in completions]


async def async_length(completions, **kwargs):
    await asyncio.sleep(0.01)
    return [10.0 * len(c) for c in completions]


def _score(runner: RewardRunner):
    started = time.perf_counter()
    out = runner.score(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=IDS, columns={})
    return out, time.perf_counter() - started


@pytest.fixture(autouse=True)
def _loop_started():
    async_loop.get_loop()  # the one-off thread start is not part of any timing


def test_slow_sync_and_async_rewards_score_none_quickly_and_the_others_still_score(caplog):
    runner = RewardRunner(resolve_reward_funcs([slow_sync, length_reward, slow_async, async_length]),
                          timeout_s=LIMIT_S)
    with caplog.at_level(logging.WARNING, logger="grpo_lightning"):
        out, seconds = _score(runner)
    assert seconds < BOUND_S  # both slow calls waited ~LIMIT_S, not SLEEP_S
    assert torch.isnan(out.rewards[:, 0]).all() and torch.isnan(out.rewards[:, 2]).all()
    assert out.rewards[:, 1].tolist() == [1.0, 1.0, 1.0, 2.0]
    assert out.rewards[:, 3].tolist() == [10.0, 10.0, 10.0, 20.0]
    assert out.timed_out == [True, False, True, False]
    # only calls that returned in time contribute log_metric / log_extra values
    assert out.logged_metrics == {"on_time_metric": [2.0]} and out.extra_columns == {}
    for name in ("slow_sync", "slow_async"):
        assert f"reward function '{name}' did not return within 0.2 s (data.reward_timeout_s)" in caplog.text
        assert f"rewards/{name}/frac_timeout" in caplog.text
    assert "background thread" in caplog.text and "cancelled" in caplog.text


def test_calls_within_the_limit_are_unchanged():
    funcs = resolve_reward_funcs([length_reward, async_length])
    plain = RewardRunner(funcs).score(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=IDS)
    limited, _ = _score(RewardRunner(funcs, timeout_s=30))
    assert torch.equal(plain.rewards, limited.rewards)
    assert limited.timed_out == [] and limited.logged_metrics == plain.logged_metrics


def test_a_still_running_call_is_not_started_again():
    calls, release = [], threading.Event()

    def hung(completions, **kwargs):
        calls.append(1)
        release.wait(SLEEP_S)
        return [0.0] * len(completions)

    runner = RewardRunner(resolve_reward_funcs([hung, length_reward]), timeout_s=LIMIT_S)
    first, _ = _score(runner)
    second, seconds = _score(runner)  # the first call is still blocked in its thread
    assert seconds < LIMIT_S  # skipped at once, not waited for again
    assert first.timed_out == second.timed_out == [True, False] and len(calls) == 1
    release.set()
    deadline = time.monotonic() + BOUND_S
    while runner._callers[0].busy and time.monotonic() < deadline:
        time.sleep(0.01)
    third, _ = _score(runner)  # the background call finished: the next batch calls again
    assert len(calls) == 2 and third.timed_out == [] and third.rewards[:, 0].tolist() == [0.0] * 4


def test_a_reward_model_past_its_limit_scores_none_and_stops_at_the_next_chunk():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tok = build_char_tokenizer()
    net = LlamaForSequenceClassification(LlamaConfig(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id))
    forwards = []

    def slow_forward(module, args, kwargs):
        forwards.append(1)
        time.sleep(1.0)  # each chunk of one text takes 1 s: the 4 texts would take 4 s

    net.register_forward_pre_hook(slow_forward, with_kwargs=True)
    model = RewardModel(net, tok, batch_size=1, name="slow_rm")
    runner = RewardRunner(resolve_reward_funcs([model, length_reward]), timeout_s=LIMIT_S)
    out, seconds = _score(runner)
    assert seconds < BOUND_S and out.timed_out == [True, False]  # returned at the limit, mid-chunk
    assert torch.isnan(out.rewards[:, 0]).all() and out.rewards[:, 1].tolist() == [1.0, 1.0, 1.0, 2.0]
    deadline = time.monotonic() + 3.0  # the first chunk ends after 1 s
    while runner._callers[0].busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not runner._callers[0].busy and len(forwards) == 1  # cancelled before the second chunk
    net._forward_pre_hooks.clear()
    scored, _ = _score(runner)  # the flag is reset: the next call scores normally
    assert scored.timed_out == [] and torch.isfinite(scored.rewards).all()


def test_an_async_reward_that_blocks_the_event_loop_is_given_up_on(caplog):
    async def blocks_loop(completions, **kwargs):
        time.sleep(2.5)  # no await: asyncio cannot cancel this
        return [1.0] * len(completions)

    runner = RewardRunner(resolve_reward_funcs([blocks_loop, length_reward]), timeout_s=LIMIT_S)
    with caplog.at_level(logging.WARNING, logger="grpo_lightning"):
        out, seconds = _score(runner)
    assert seconds < 2.4 and seconds >= async_deadline([LIMIT_S]) - 0.05  # the grace period, not the sleep
    assert out.timed_out == [True, False] and torch.isnan(out.rewards[:, 0]).all()
    assert "event loop was blocked" in caplog.text and "asyncio.to_thread" in caplog.text
    async_loop.run(asyncio.sleep(0), timeout=5)  # the loop is free again for the next tests


def test_errors_raised_in_time_are_errors_not_timeouts():
    def own_timeout(**kwargs):
        raise TimeoutError("the judge's HTTP client timed out")

    async def own_async_timeout(**kwargs):
        raise TimeoutError("async judge timed out")

    for func in (own_timeout, own_async_timeout):
        runner = RewardRunner(resolve_reward_funcs([func]), timeout_s=5)
        with pytest.raises(TimeoutError, match="timed out") as info:
            _score(runner)
        assert f"reward function '{func.__name__}'" in "".join(getattr(info.value, "__notes__", []))


def test_per_function_limits_and_bad_settings():
    assert resolve_timeouts(None, ["a", "b"]) == [None, None]
    assert resolve_timeouts(3, ["a", "b"]) == [3.0, 3.0]
    assert resolve_timeouts({"b": 0.5}, ["a", "b"]) == [None, 0.5]
    runner = RewardRunner(resolve_reward_funcs([slow_sync, length_reward]), timeout_s={"slow_sync": LIMIT_S})
    out, seconds = _score(runner)
    assert seconds < BOUND_S and out.timed_out == [True, False] and runner.timeouts == [LIMIT_S, None]
    for bad in (0, -1, float("inf"), float("nan"), True, "5"):
        with pytest.raises(ValueError, match=r"data.reward_timeout_s.*positive number"):
            resolve_timeouts(bad, ["a"])
    with pytest.raises(ValueError, match=r"data.reward_timeout_s.a=0.*positive"):
        resolve_timeouts({"a": 0}, ["a"])
    with pytest.raises(ValueError, match=r"names 'nope', which is not a reward function.*'a', 'b'"):
        resolve_timeouts({"nope": 1.0}, ["a", "b"])


def test_frac_timeout_metric_over_ranks():
    # Rank 1's call of `judge` times out (4 of 8 completions), rank 0's does not; `fmt` never does.
    def judge(completions, slow, **kwargs):
        if slow[0]:
            time.sleep(SLEEP_S)
        return [1.0] * len(completions)

    def fmt(completions, **kwargs):
        return [0.5] * len(completions)

    ranks = ThreadRanks(2)

    def build(rank):
        builder = make_builder([judge, fmt], ranks.collective(rank))
        builder.rewards = RewardRunner(resolve_reward_funcs([judge, fmt]), timeout_s={"judge": LIMIT_S})
        row_ids = [2 * rank, 2 * rank, 2 * rank + 1, 2 * rank + 1]
        rows = [{"prompt": f"{i}+1=", "slow": rank == 1} for i in row_ids]
        return builder.build(rows, row_ids, None).micro_batches[0].generation_metrics

    started = time.perf_counter()
    metrics = ranks.run(build)
    assert time.perf_counter() - started < BOUND_S + 1.0
    for rank_metrics in metrics:
        assert rank_metrics["rewards/judge/frac_timeout"] == 0.5
        assert "rewards/fmt/frac_timeout" not in rank_metrics  # no limit, no metric
        assert rank_metrics["rewards/judge/frac_none"] == 0.5 and rank_metrics["rewards/judge/mean"] == 1.0
    # Without a timeout nothing is gathered and no metric appears; with one and no timeout: 0.0.
    plain = make_builder([fmt], ThreadRanks(1).collective(0))
    row_ids = [0, 0, 1, 1]
    rows = [{"prompt": f"{i}+1="} for i in row_ids]
    assert not any("frac_timeout" in k for k in plain.build(rows, row_ids, None).micro_batches[0].generation_metrics)
    plain.rewards = RewardRunner(resolve_reward_funcs([fmt]), timeout_s=30)
    assert plain.build(rows, row_ids, None).micro_batches[0].generation_metrics["rewards/fmt/frac_timeout"] == 0.0


def test_gathered_metric_weights_ranks_by_their_rows():
    # rank 0 scored 6 rows (timed out), rank 1 scored 2 (in time): 6 / 8, not the mean of 1 and 0.
    per_rank = [torch.tensor([[6.0, 6.0]]), torch.tensor([[0.0, 2.0]])]
    got = gathered_timeout_metrics([True], 6, lambda local: torch.cat(per_rank), ["j"], [1.0])
    assert got == {"rewards/j/frac_timeout": 0.75}
    assert math.isclose(gathered_timeout_metrics([], 4, lambda t: t, ["j"], [1.0])["rewards/j/frac_timeout"], 0.0)


def test_datamodule_setting_reaches_the_metrics_of_a_run(tmp_path):
    import lightning.pytorch as pl

    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.types import GenerationParams
    from tests.helpers import make_model_dir, write_prompts

    release = threading.Event()

    def sleepy(completions, **kwargs):
        release.wait(60)  # hangs for the whole run unless released
        return [1.0] * len(completions)

    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[sleepy, "tests.helpers.length_reward"],
                             reward_timeout_s={"sleepy": LIMIT_S}, num_generations=4, per_device_train_batch_size=8,
                             generation=GenerationParams(max_completion_length=3))
    trainer = pl.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    started = time.perf_counter()
    try:
        trainer.fit(GRPOModule(make_model_dir(tmp_path / "m"), save_final_model=False), data)
    finally:
        release.set()
    assert time.perf_counter() - started < 30  # the run went on without waiting for the reward (60 s)
    metrics = data.buffer.batches[0].generation_metrics
    assert metrics["rewards/sleepy/frac_timeout"] == 1.0 and metrics["rewards/sleepy/frac_none"] == 1.0
    assert "rewards/length_reward/frac_timeout" not in metrics and metrics["frac_reward_none"] == 0.0
    with pytest.raises(ValueError, match="data.reward_timeout_s"):
        RolloutDataModule(write_prompts(tmp_path / "q.jsonl"), reward_funcs=[sleepy], reward_timeout_s=-1.0)


def test_the_worker_thread_uses_the_calling_threads_cuda_device(monkeypatch):
    # Under DDP each rank sets its own current CUDA device, which a new thread would not inherit.
    set_in = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: set_in.setdefault(threading.current_thread().name, d))

    def on_device(completions, **kwargs):
        return [1.0] * len(completions)

    out, _ = _score(RewardRunner(resolve_reward_funcs([on_device]), timeout_s=5))
    assert out.rewards[:, 0].tolist() == [1.0] * 4 and set_in == {"grpo-reward-on_device": 3}
