"""CompletionLogger: the rich table a person reads, unique prompts, and the Hub dataset push
(tested at the call boundary: ``create_repo`` and ``Dataset.push_to_hub`` are replaced, nothing
reaches the network)."""

from __future__ import annotations

import io
import logging
import random
from types import SimpleNamespace

import pandas as pd
import pytest
from rich.console import Console

from grpo_lightning.callbacks import CompletionLogger
from grpo_lightning.callbacks.completion_hub import completions_dataset
from grpo_lightning.types import CompletionTable


def make_table(step: int = 1) -> CompletionTable:
    return CompletionTable(step, {
        "prompt": ["1+1=", "1+1=", "2+2=", "2+2="],
        "completion": ["2", "[bold]3[/bold]", "4", "five"],
        "reward/exact": [1.0, 0.0, 1.0, float("nan")],
        "reward/length": [1.0, 14.0, 1.0, 4.0],
        "advantage": [0.5, -0.5, 0.71, -0.71],
        "parsed": ["2", "3", "4", None],
    })  # fmt: skip


def fake_trainer(tmp_path, table, step=1, rank_zero=True):
    return SimpleNamespace(
        global_step=step, log_every_n_steps=1, is_global_zero=rank_zero, loggers=[], default_root_dir=str(tmp_path),
        datamodule=SimpleNamespace(completion_table=table, collect_completions=False),
    )


def run_step(callback, trainer, step, table=None):
    trainer.global_step = step
    trainer.datamodule.completion_table = table or make_table(step)
    callback.on_train_batch_end(trainer, None, None, None, 0)


def recorded(callback) -> Console:
    callback.console = Console(record=True, width=200, file=io.StringIO())
    return callback.console


def test_rich_table_shows_prompts_completions_rewards_advantages_and_extras(tmp_path):
    callback = CompletionLogger()
    console = recorded(callback)
    run_step(callback, fake_trainer(tmp_path, None), 3)
    text = console.export_text()
    assert "Step 3" in text
    for header in ("Prompt", "Completion", "exact", "length", "Advantage", "parsed"):
        assert header in text
    for cell in ("1+1=", "2+2=", "five", "14.00", "0.71", "-0.71", "None"):
        assert cell in text
    assert "[bold]3[/bold]" in text  # completions are literal text, never rich markup
    assert text.count("1+1=") == 2 and text.count("2+2=") == 2  # all four rows (TRL default: None = all)


def test_unique_prompts_and_row_limit(tmp_path):
    callback = CompletionLogger(log_unique_prompts=True)
    console = recorded(callback)
    trainer = fake_trainer(tmp_path, None)
    run_step(callback, trainer, 1)
    text = console.export_text()
    assert text.count("1+1=") == 1 and text.count("2+2=") == 1  # each prompt once: its first completion
    assert "[bold]3[/bold]" not in text and "five" not in text
    saved = pd.read_parquet(tmp_path / "completions" / "completions_00001.parquet")
    assert len(saved) == 4 and saved["step"].tolist() == [1] * 4  # the parquet file keeps every row

    state = random.getstate()
    limited = CompletionLogger(num_completions_to_print=2)
    texts = []
    for _ in range(2):
        console = recorded(limited)
        limited._last_logged_step = -1
        run_step(limited, trainer, 5)
        texts.append(console.export_text())
    assert random.getstate() == state  # the sample uses a private RNG
    assert texts[0] == texts[1]  # the same rows for the same step
    assert texts[0].count("1+1=") + texts[0].count("2+2=") == 2  # two of the four rows

    silent = CompletionLogger(num_completions_to_print=0)
    console = recorded(silent)
    run_step(silent, trainer, 1)
    assert console.export_text() == ""


def test_default_console_prints_to_stdout_on_rank_zero_only(tmp_path, capsys):
    run_step(CompletionLogger(), fake_trainer(tmp_path, None), 1)
    out = capsys.readouterr().out
    assert "Step 1" in out and "five" in out and "Advantage" in out
    run_step(CompletionLogger(), fake_trainer(tmp_path, None, rank_zero=False), 1)
    assert capsys.readouterr().out == ""


class FakeHub:
    """Stands in for ``huggingface_hub.create_repo`` and ``datasets.Dataset.push_to_hub``."""

    def __init__(self, monkeypatch, fail_pushes: int = 0):
        import datasets
        import huggingface_hub

        self.created, self.pushes, self.fail_pushes = [], [], fail_pushes

        def create_repo(repo_id, **kwargs):
            self.created.append((repo_id, kwargs))
            return SimpleNamespace(repo_id=repo_id if "/" in repo_id else f"me/{repo_id}")

        def push_to_hub(dataset, repo_id, **kwargs):
            if self.fail_pushes:
                self.fail_pushes -= 1
                raise ConnectionError("no network in tests")
            self.pushes.append((repo_id, dataset.column_names, dataset.to_pandas(), kwargs))

        monkeypatch.setattr(huggingface_hub, "create_repo", create_repo)
        monkeypatch.setattr(datasets.Dataset, "push_to_hub", push_to_hub)


def test_hub_repo_created_before_training_and_every_logged_row_pushed(tmp_path, monkeypatch):
    hub = FakeHub(monkeypatch)
    callback = CompletionLogger(num_completions_to_print=0, log_completions_hub_repo="completions",
                                hub_private_repo=True, hub_push_interval_s=0, log_unique_prompts=True)
    trainer = fake_trainer(tmp_path, None)
    callback.setup(trainer, None, "fit")
    assert trainer.datamodule.collect_completions is True
    assert hub.created == [("completions", {"repo_type": "dataset", "private": True, "exist_ok": True})]
    run_step(callback, trainer, 1)
    run_step(callback, trainer, 2)
    assert len(hub.pushes) == 2
    repo_id, names, rows, kwargs = hub.pushes[-1]
    assert repo_id == "me/completions" and kwargs["private"] is True and "step 2" in kwargs["commit_message"]
    assert names == ["step", "prompt", "completion", "reward/exact", "reward/length", "advantage", "parsed"]
    assert rows["step"].tolist() == [1] * 4 + [2] * 4  # all steps, all rows (unique prompts thin the views only)
    assert rows["completion"].tolist()[:4] == ["2", "[bold]3[/bold]", "4", "five"]
    assert rows["reward/length"].tolist() == [1.0, 14.0, 1.0, 4.0] * 2 and pd.isna(rows["reward/exact"][3])
    callback.teardown(trainer, None, "fit")
    assert len(hub.pushes) == 2  # nothing new to push


def test_hub_pushes_are_throttled_retried_and_flushed_at_fit_end(tmp_path, monkeypatch, caplog):
    hub = FakeHub(monkeypatch, fail_pushes=1)
    callback = CompletionLogger(num_completions_to_print=0, log_completions_hub_repo="org/runs", hub_push_interval_s=3600)
    trainer = fake_trainer(tmp_path, None)
    callback.setup(trainer, None, "fit")
    with caplog.at_level(logging.WARNING, logger="grpo_lightning"):
        run_step(callback, trainer, 1)  # the first push fails: logged, training goes on
    assert hub.pushes == [] and "'org/runs' failed (ConnectionError" in caplog.text
    run_step(callback, trainer, 2)  # retried: the failed push left the rows pending
    run_step(callback, trainer, 3)  # within the interval: not pushed yet
    assert [p[2]["step"].max() for p in hub.pushes] == [2]
    callback.teardown(trainer, None, "fit")  # fit end pushes the rest
    assert [p[2]["step"].max() for p in hub.pushes] == [2, 3] and len(hub.pushes[-1][2]) == 12

    other = fake_trainer(tmp_path / "rank1", None, rank_zero=False)
    quiet = CompletionLogger(log_completions_hub_repo="org/runs", hub_push_interval_s=0)
    quiet.setup(other, None, "fit")
    run_step(quiet, other, 1)
    quiet.teardown(other, None, "fit")
    assert len(hub.created) == 1 and len(hub.pushes) == 2  # rank 1 creates and pushes nothing


def test_dataset_of_steps_with_different_columns(tmp_path):
    folder = tmp_path / "completions"
    folder.mkdir()
    pd.DataFrame({"step": [1], "prompt": ["a"], "advantage": [0.5]}).to_parquet(folder / "completions_00001.parquet")
    pd.DataFrame({"step": [2], "prompt": ["b"], "advantage": [1.0], "extra": ["x"]}).to_parquet(
        folder / "completions_00002.parquet")
    data = completions_dataset(str(folder))
    assert data.num_rows == 2 and data["prompt"] == ["a", "b"] and data["extra"] == [None, "x"]


def test_bad_settings_fail_at_construction():
    with pytest.raises(ValueError, match="save_parquet: true"):
        CompletionLogger(log_completions_hub_repo="me/x", save_parquet=False)
    with pytest.raises(ValueError, match="num_completions_to_print=-1"):
        CompletionLogger(num_completions_to_print=-1)
    with pytest.raises(ValueError, match="log_completions_hub_repo='a/b/c'"):
        CompletionLogger(log_completions_hub_repo="a/b/c")
    with pytest.raises(ValueError, match="hub_push_interval_s=-1"):
        CompletionLogger(log_completions_hub_repo="x", hub_push_interval_s=-1)


@pytest.mark.slow
def test_a_fit_prints_the_table_and_pushes_its_rows(tmp_path, monkeypatch, capsys):
    import lightning.pytorch as pl

    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.types import GenerationParams
    from tests.helpers import make_model_dir, write_prompts

    hub = FakeHub(monkeypatch)
    data = RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=["tests.helpers.length_reward"],
                             num_generations=4, per_device_train_batch_size=8,
                             generation=GenerationParams(max_completion_length=3))
    callback = CompletionLogger(num_completions_to_print=3, log_completions_hub_repo="me/grpo-completions",
                                hub_push_interval_s=0)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_progress_bar=False, log_every_n_steps=1,
                         enable_model_summary=False, enable_checkpointing=False, default_root_dir=str(tmp_path / "run"),
                         callbacks=[callback])
    trainer.fit(GRPOModule(make_model_dir(tmp_path / "m"), save_final_model=False), data)
    out = capsys.readouterr().out
    assert "Step 1" in out and "Step 2" in out and "length_reward" in out and "Advantage" in out
    assert [name for name, _ in hub.created] == ["me/grpo-completions"]
    assert [p[2]["step"].tolist() for p in hub.pushes] == [[1] * 8, [1] * 8 + [2] * 8]
    rows = hub.pushes[-1][2]
    assert {"prompt", "completion", "reward/length_reward", "advantage"} <= set(rows.columns)
    assert (rows["reward/length_reward"] == rows["completion"].str.len()).all()  # the rows the rewards scored


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_run_resumed_inside_a_generation_batch_still_logs_its_completions(tmp_path, accumulate):
    """``num_iterations: 2``: steps 1 and 2 train on one generation batch. Resumed from step 1's
    checkpoint, the run replays that batch from the checkpoint and logs step 2's table, the one
    a run that never stopped logs; step 1 is not logged again."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule
    from grpo_lightning.types import GenerationParams
    from tests.helpers import make_model_dir, write_prompts

    model, prompts = make_model_dir(tmp_path / "m"), write_prompts(tmp_path / "p.jsonl")

    def fit(run, max_steps, ckpt_path=None):
        data = RolloutDataModule(prompts, reward_funcs=["tests.helpers.length_reward"], num_generations=4,
                                 per_device_train_batch_size=8, num_iterations=2, seed=5,
                                 generation=GenerationParams(max_completion_length=3))
        callbacks = [CompletionLogger(every_n_steps=1, num_completions_to_print=0),
                     ModelCheckpoint(dirpath=tmp_path / run / "ckpt", every_n_train_steps=1, save_top_k=-1,
                                     filename="{step}")]
        trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=str(tmp_path / run), callbacks=callbacks,
                             accumulate_grad_batches=accumulate)
        pl.seed_everything(0)
        trainer.fit(GRPOModule(model, save_final_model=False), data, ckpt_path=ckpt_path)
        return tmp_path / run / "completions"

    straight = fit("straight", 2)
    fit("resumed", 1)
    (tmp_path / "resumed" / "completions" / "completions_00001.parquet").unlink()  # what the resume writes, below
    resumed = fit("resumed", 2, ckpt_path=str(tmp_path / "resumed" / "ckpt" / "step=1.ckpt"))
    assert sorted(p.name for p in resumed.iterdir()) == ["completions_00002.parquet"]
    pd.testing.assert_frame_equal(pd.read_parquet(resumed / "completions_00002.parquet"),
                                  pd.read_parquet(straight / "completions_00002.parquet"))
