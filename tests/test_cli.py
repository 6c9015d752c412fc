"""``grpo fit`` end to end: YAML config, overrides, MLflow by default, clear config errors."""

from __future__ import annotations

import pytest
import yaml

from grpo_lightning.cli import main
from tests.helpers import make_model_dir, write_prompts


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    config = {
        "trainer": {"max_steps": 2, "accelerator": "cpu", "default_root_dir": str(root / "run"), "log_every_n_steps": 1,
                    "enable_progress_bar": False},
        "model": {"model": make_model_dir(root / "model"), "loss": "grpo", "learning_rate": 1e-2},
        "data": {
            "dataset": write_prompts(root / "prompts.jsonl"),
            "reward_funcs": ["tests.helpers.length_reward", "tests.helpers.count_a_reward"],
            "reward_weights": [1.0, 0.5],
            "num_generations": 4,
            "per_device_train_batch_size": 8,
            "generation": {"max_completion_length": 6},
        },
    }
    path = root / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, root / "run"


@pytest.mark.slow
def test_fit_logs_metrics_params_and_config_to_mlflow(config_file):
    from mlflow.tracking import MlflowClient

    path, run_dir = config_file
    main(["fit", "--config", str(path)])
    client = MlflowClient(f"sqlite:///{run_dir}/mlflow.db")
    experiment = client.get_experiment_by_name("grpo")
    (run,) = client.search_runs([experiment.experiment_id])
    metrics = run.data.metrics
    for name in ["reward", "reward_std", "loss", "entropy", "num_tokens", "step_time", "learning_rate", "grad_norm",
                 "frac_reward_zero_std", "completions/mean_length", "completions/clipped_ratio",
                 "rewards/length_reward/mean", "rewards/count_a_reward/std", "clip_ratio/region_mean"]:
        assert name in metrics, f"{name} not logged; got {sorted(metrics)}"
    assert len(client.get_metric_history(run.info.run_id, "reward")) == 2  # log_every_n_steps=1
    # `loss: grpo` is recorded as what ran: the class and every knob
    assert run.data.params["config/model.loss.class_path"] == '"grpo_lightning.losses.GRPOLoss"'
    assert run.data.params["config/model.loss.init_args.epsilon"] == "0.2"
    assert run.data.params["config/data.sampler.class_path"] == '"grpo_lightning.samplers.HFGenerateSampler"'
    assert run.data.params["config/data.num_generations"] == "4"
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id)]
    assert "config.yaml" in artifacts
    assert (run_dir / "final_model" / "config.json").exists()
    assert (run_dir / "config.yaml").exists()


def test_print_config_shows_defaults_and_overrides(config_file, capsys):
    path, _ = config_file
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), "--model.learning_rate", "0.5", "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["learning_rate"] == 0.5
    assert printed["data"]["generation"]["temperature"] == 1.0
    assert printed["trainer"]["gradient_clip_val"] == 1.0  # TRL's max_grad_norm


def test_reward_names_survive_the_saved_config(config_file, capsys):
    """Built-in reward names, dotted paths and reward-model specs are written back as given, so the
    saved ``config.yaml`` re-runs the same job."""
    path, _ = config_file
    rewards = ["exact_match_reward", "tests.helpers.length_reward",
               {"class_path": "grpo_lightning.rewards.RewardModel", "init_args": {"model": "some/path"}}]
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), "--data.reward_funcs", yaml.safe_dump(rewards, default_flow_style=True),
              "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["data"]["reward_funcs"][:2] == rewards[:2]
    assert printed["data"]["reward_funcs"][2]["class_path"] == "grpo_lightning.rewards.RewardModel"
    assert printed["data"]["reward_funcs"][2]["init_args"]["model"] == "some/path"


def test_unknown_config_key_is_named(config_file, tmp_path, capsys):
    path, _ = config_file
    config = yaml.safe_load(path.read_text())
    config["data"]["num_generation"] = 4  # typo
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(bad)])
    assert exit_info.value.code != 0
    assert "num_generation" in capsys.readouterr().err


def test_print_config_writes_loss_and_sampler_names_in_full(config_file, capsys):
    """`loss: dapo` and `sampler: hf_generate` print as class_path + every init_arg."""
    path, _ = config_file
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), "--model.loss", "dapo", "--data.sampler", "hf_generate", "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["loss"]["class_path"] == "grpo_lightning.losses.DAPOLoss"
    assert printed["model"]["loss"]["init_args"]["epsilon"] == 0.2
    assert printed["model"]["loss"]["init_args"]["beta"] == 0.0
    assert printed["data"]["sampler"] == {
        "class_path": "grpo_lightning.samplers.HFGenerateSampler",
        "init_args": {"cache_implementation": None, "max_batch_rows": None, "cache_weight_casts": True},
    }


@pytest.mark.parametrize("given", [[], ["--model.loss", "grpo"], ["--model.loss=grpo"]])
def test_knobs_of_a_loss_given_by_name_can_be_overridden(config_file, capsys, given):
    """The config file says ``loss: grpo``, or the command line names it: later arguments set its
    knobs (jsonargparse cannot set ``init_args`` on a plain string)."""
    path, _ = config_file
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(path), *given, "--model.loss.init_args.beta", "0.04", "--model.loss.epsilon",
              "0.3", "--print_config"])
    assert exit_info.value.code == 0
    loss = yaml.safe_load(capsys.readouterr().out)["model"]["loss"]
    assert loss["class_path"] == "grpo_lightning.losses.GRPOLoss"
    assert (loss["init_args"]["beta"], loss["init_args"]["epsilon"]) == (0.04, 0.3)


def test_default_loss_knobs_can_be_overridden_and_printed(config_file, capsys):
    path, _ = config_file
    config = yaml.safe_load(path.read_text())
    del config["model"]["loss"]  # the default, DAPOLoss
    bare = path.parent / "default_loss.yaml"
    bare.write_text(yaml.safe_dump(config))
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(bare), "--model.loss.epsilon", "0.3", "--print_config"])
    loss = yaml.safe_load(capsys.readouterr().out)["model"]["loss"]
    assert loss["class_path"] == "grpo_lightning.losses.DAPOLoss"
    assert loss["init_args"]["epsilon"] == 0.3 and loss["init_args"]["beta"] == 0.0


def test_help_is_short_and_lists_no_module_subclasses(capsys):
    """`--model.model` once listed every torch.nn.Module subclass (hundreds of help lines)."""
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    out = capsys.readouterr().out
    assert "torch.nn.Linear" not in out and "known subclasses: torch.nn" not in out
    model_help = out[out.index("  --model.model MODEL"):out.index("  --model.tokenizer")]
    assert len(model_help.splitlines()) <= 4, model_help
    # Lightning's own options are most of it (~950 lines alone); its "known subclasses" lists also
    # name every Callback/Logger subclass the process has imported, e.g. the test suite's own.
    assert len(out.splitlines()) < 1200
    assert "GRPO_DEBUG=1" in out and "--overwrite_run_dir" in out  # the epilog and the run-folder switch


def test_help_works_without_optional_extras(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "--data.num_generations" in out and "--model.loss" in out
    assert "Completions per prompt" in out  # docstrings are the CLI help


def test_the_offline_hub_kernel_notice_of_bitsandbytes_is_dropped():
    import logging

    from grpo_lightning.cli import _drop_hub_kernel_notice

    def record(msg):
        return logging.LogRecord("bitsandbytes.backends.cpu.ops", logging.WARNING, "ops.py", 1, msg, (), None)

    assert not _drop_hub_kernel_notice(record("Failed to load CPU gemm_4bit_forward from kernels-community: %s."))
    assert _drop_hub_kernel_notice(record("any other bitsandbytes warning"))
