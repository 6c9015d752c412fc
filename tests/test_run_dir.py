"""A run folder holds one run: `grpo fit` refuses a used `default_root_dir` unless resuming or told to overwrite."""

from __future__ import annotations

import pytest
import yaml

from grpo_lightning.cli import main
from grpo_lightning.cli.run_dir import check_run_dir
from grpo_lightning.errors import ConfigError
from tests.helpers import fit_config, write_config


@pytest.mark.parametrize("marker", ["config.yaml", "final_model", "completions", "checkpoints"])
def test_a_used_folder_is_refused_naming_the_setting_and_the_fixes(tmp_path, marker):
    (tmp_path / marker).mkdir()
    with pytest.raises(ConfigError, match="trainer.default_root_dir") as info:
        check_run_dir(str(tmp_path), ckpt_path=None, overwrite=False)
    assert "--ckpt_path" in str(info.value) and "--overwrite_run_dir" in str(info.value)


def test_what_is_allowed(tmp_path):
    check_run_dir(str(tmp_path / "new"), ckpt_path=None, overwrite=False)  # a new folder
    (tmp_path / "mlflow.db").touch()  # a store alone (a run that failed before training) is no run
    check_run_dir(str(tmp_path), ckpt_path=None, overwrite=False)
    (tmp_path / "config.yaml").touch()
    check_run_dir(str(tmp_path), ckpt_path=None, overwrite=True)
    check_run_dir(str(tmp_path), ckpt_path=str(tmp_path / "1" / "run" / "checkpoints" / "last.ckpt"), overwrite=False)
    check_run_dir(str(tmp_path), ckpt_path="last", overwrite=False)
    with pytest.raises(ConfigError, match="another folder"):  # resuming a different run into this one
        check_run_dir(str(tmp_path), ckpt_path=str(tmp_path.parent / "other.ckpt"), overwrite=False)


def test_output_dir_with_a_final_model_is_checked_too(tmp_path):
    (tmp_path / "export" / "final_model").mkdir(parents=True)
    with pytest.raises(ConfigError, match="final_model"):
        check_run_dir(str(tmp_path / "run"), ckpt_path=None, overwrite=False, output_dir=str(tmp_path / "export"))


@pytest.fixture
def config(tmp_path):
    return write_config(tmp_path / "cfg.yaml", fit_config(tmp_path, trainer={"enable_checkpointing": False},
                                                          model={"save_final_model": False}))


def test_grpo_fit_refuses_a_second_run_before_loading_anything(config, tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("from: an earlier run\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config)])
    assert exit_info.value.code == 1
    assert "trainer.default_root_dir" in capsys.readouterr().err
    assert (tmp_path / "run" / "config.yaml").read_text() == "from: an earlier run\n"  # untouched
    assert not (tmp_path / "run" / "mlflow.db").exists()  # refused before the logger was made


def test_a_run_that_fails_before_training_leaves_the_folder_reusable(config, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(config), "--data.prompt_column", "nope"])  # fails in setup
    assert not (tmp_path / "run" / "config.yaml").exists()
    capsys.readouterr()


@pytest.mark.slow
def test_overwrite_switch_runs_again(config, tmp_path):
    main(["fit", "--config", str(config)])
    assert (tmp_path / "run" / "config.yaml").exists()
    main(["fit", "--config", str(config), "--overwrite_run_dir", "true"])
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["overwrite_run_dir"] is True
