"""`grpo` prints a user error as one message (no traceback); GRPO_DEBUG=1 shows the traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from grpo_lightning.cli import main
from grpo_lightning.errors import ConfigError, is_user_error, raised_in_package
from grpo_lightning.losses import get_loss
from tests.helpers import fit_config, write_config


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("errors")
    return write_config(root / "cfg.yaml", fit_config(root, model={"learning_rate": 1e-2}))


def run_grpo(args, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("override, message", [
    (["--model.learning_rate", "-1"], "model.learning_rate=-1"),              # the module's own check
    (["--model.loss", "ppo"], "model.loss='ppo': unknown loss"),                         # the loss registry
    (["--data.num_generations", "1"], "data.num_generations=1"),               # a data check
    (["--data.dataset", "missing.jsonl"], "missing.jsonl"),                    # a file that is not there
    # checks of settings nested in a union type, which jsonargparse wraps in its union error
    (["--model.peft_config.lora_dropout", "1.5"], "model.peft_config.lora_dropout=1.5: use a probability"),
    (["--model.peft_config.r", "0"], "model.peft_config.r=0"),
    (["--data.dynamic_sampling.max_extra_rounds", "-1"], "data.dynamic_sampling.max_extra_rounds=-1"),
    # a component's own check, with where its argument lives in the config in front
    (["--model.loss.epsilon", "-0.2"], "error: model.loss.init_args.epsilon=-0.2: it must be >= 0.0"),
    (["--model.loss", "bnpo", "--model.loss.init_args.normalizer", "step", "--model.loss.init_args.delta", "0.5"],
     "error: model.loss.init_args.delta=0.5: the two-sided clipping cap must be > 1"),
    (["--data.sampler", "fast_generate", "--data.sampler.init_args.max_batch_rows", "-3"],
     "error: data.sampler.init_args.max_batch_rows=-3: use a positive number"),
    (["--data.generation.temperature", "-1"], "data.generation.temperature=-1"),
    (["--data.generation.top_p", "1.5"], "data.generation.top_p=1.5: it must be in (0, 1]"),
    # generation_kwargs that would sample something other than what the run trains on, or a typo
    (["--data.generation.generation_kwargs", '{"temperature": 0.5}'], "set data.generation.temperature instead"),
    (["--data.generation.generation_kwargs", '{"num_return_sequences": 2}'], "data.num_generations"),
    (["--data.generation.generation_kwargs", '{"tempreature": 0.5}'], "['tempreature'] is not a setting of "
                                                                       "data.sampler: hf_generate"),
    # trainer settings Lightning accepts but that train wrongly or fail after the first step
    (["--data.sampler", "hf_generate", "--data.sampler.init_args.cache_implementation", "statc"],
     "data.sampler.init_args.cache_implementation='statc': use one of"),
    (["--trainer.gradient_clip_val", "-1"], "trainer.gradient_clip_val=-1"),
    (["--trainer.log_every_n_steps", "0"], "trainer.log_every_n_steps=0"),
    (["--trainer.val_check_interval", "0"], "trainer.val_check_interval=0"),
    (["--trainer.check_val_every_n_epoch", "0"], "trainer.check_val_every_n_epoch=0"),
    (["--trainer.limit_train_batches", "0"], "trainer.limit_train_batches=0 trains nothing"),
])
def test_user_errors_print_one_message_without_traceback(config, capsys, override, message):
    code, err = run_grpo(["fit", "--config", str(config), *override], capsys)
    assert code == 1
    assert message in err and "GRPO_DEBUG=1" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) <= 4, err


def test_a_bad_model_init_kwarg_is_one_message_when_the_model_loads(config, capsys):
    """Raised by transformers once the run has started (its plan lines come first), named by our key."""
    code, err = run_grpo(["fit", "--config", str(config), "--trainer.logger", "false", "--model.model_init_kwargs",
                          '{"attn_implementation": "no_such_kernel"}'], capsys)
    assert code == 1 and "Traceback" not in err, err
    assert "error: model.model_init_kwargs={'attn_implementation': 'no_such_kernel'}: " \
           "AutoModelForCausalLM.from_pretrained(" in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="needs a machine without a CUDA device")
def test_a_gpu_config_on_a_machine_without_one_names_the_setting(config, capsys):
    code, err = run_grpo(["fit", "--config", str(config), "--trainer.accelerator", "gpu"], capsys)
    assert code == 1 and "trainer.accelerator=gpu: this machine has no CUDA device" in err
    assert "Traceback" not in err


def test_parse_errors_are_short(config, capsys):
    """jsonargparse printed ~100 lines of usage before the one line that matters."""
    code, err = run_grpo(["fit", "--config", str(config), "--data.num_generation", "3"], capsys)
    assert code == 2
    assert "num_generation" in err and len(err.strip().splitlines()) <= 4, err


def test_debug_switch_shows_the_traceback(config, capsys, monkeypatch):
    monkeypatch.setenv("GRPO_DEBUG", "1")
    with pytest.raises(ValueError, match="model.learning_rate"):
        main(["fit", "--config", str(config), "--model.learning_rate", "-1"])


def test_errors_outside_the_package_keep_their_traceback(config, tmp_path):
    """A bug in a user's reward function is not ours to summarise."""
    with pytest.raises(ZeroDivisionError):
        main(["fit", "--config", str(config), "--data.reward_funcs", "[tests.test_errors.broken_reward]",
              "--trainer.default_root_dir", str(tmp_path / "run")])


def broken_reward(completions, **kwargs):
    return [1 / 0 for _ in completions]


def test_the_rule():
    try:
        get_loss("ppo")
    except ValueError as error:
        ours = error
    try:
        int("x")
    except ValueError as error:
        theirs = error
    assert raised_in_package(ours) and not raised_in_package(theirs)
    assert is_user_error(ours, training_started=False)
    assert not is_user_error(ours, training_started=True)  # once training runs, it may be a bug
    assert not is_user_error(theirs, training_started=False)
    assert is_user_error(ConfigError("x"), training_started=True)  # always a user error
    assert not is_user_error(RuntimeError("x"), training_started=False)


@pytest.mark.slow
def test_console_script_exit_status_and_output(config):
    env = {**os.environ, "GRPO_DEBUG": ""}
    result = subprocess.run(
        [sys.executable, "-m", "grpo_lightning.cli", "fit", "--config", str(config), "--trainer.max_steps", "0"],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert result.returncode == 1
    assert "trainer.max_steps=0" in result.stderr and "Traceback" not in result.stderr
