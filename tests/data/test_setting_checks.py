"""Data settings that would be silently ignored or do nothing are refused at construction."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grpo_lightning.algo.importance import ImportanceSamplingCorrection
from grpo_lightning.data import RolloutDataModule
from tests.helpers import length_reward, write_prompts


def test_a_system_prompt_with_text_prompts_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"data\.system_prompt is set but the prompts are plain text.*prompt_as_chat"):
        RolloutDataModule(write_prompts(tmp_path / "p.jsonl"), reward_funcs=[length_reward], system_prompt="Be brief.")


def test_a_system_prompt_goes_into_conversations(tmp_path):
    text = write_prompts(tmp_path / "text.jsonl")
    chats = write_prompts(tmp_path / "chat.jsonl", conversational=True)
    RolloutDataModule(text, reward_funcs=[length_reward], system_prompt="Be brief.", prompt_as_chat=True)
    RolloutDataModule(chats, reward_funcs=[length_reward], system_prompt="Be brief.")


def test_a_system_prompt_with_text_evaluation_prompts_is_refused(tmp_path):
    chats = write_prompts(tmp_path / "chat.jsonl", conversational=True)
    with pytest.raises(ValueError, match=r"data\.system_prompt"):
        RolloutDataModule(chats, reward_funcs=[length_reward], system_prompt="Be brief.", num_generations=4,
                          per_device_eval_batch_size=8, eval_dataset=write_prompts(tmp_path / "text.jsonl"))


@pytest.mark.parametrize("clip_max", [0.0, -1.0])
def test_a_non_positive_importance_sampling_cap_is_refused(clip_max):
    with pytest.raises(ValueError, match=rf"data\.importance_sampling\.clip_max={clip_max}: ratios are positive"):
        ImportanceSamplingCorrection(clip_min=None, clip_max=clip_max)


def test_an_unimportable_tool_names_its_place_in_the_list():
    from grpo_lightning.agents.settings import resolve_tools
    from grpo_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^data\.agent\.tools\[1\]='no_such_pkg\.tool': cannot import"):
        resolve_tools([_echo, "no_such_pkg.tool"])


def _echo(text: str) -> str:
    """Return the text.

    Args:
        text: Any text.
    """
    return text


def test_a_time_based_validation_interval_is_not_a_number_to_check():
    """Lightning takes ``val_check_interval: "DD:HH:MM:SS"`` (and then leaves the attribute unset)."""
    import lightning.pytorch as pl

    from grpo_lightning.data.run_summary import check_trainer_settings

    trainer = pl.Trainer(val_check_interval="00:00:10:00", check_val_every_n_epoch=None, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False)
    check_trainer_settings(trainer)  # the attribute is unset: nothing to check
    check_trainer_settings(SimpleNamespace(val_check_interval="00:00:10:00", log_every_n_steps=10))  # CLI section


def test_an_error_inside_a_users_reward_module_keeps_its_own_traceback(tmp_path, monkeypatch):
    """Only the package's own resolution errors are named by the setting; a ``ValueError`` raised by
    the user's class stays that error (``grpo`` then shows its traceback)."""
    import json

    from grpo_lightning.errors import is_user_error
    from grpo_lightning.rewards import resolve_reward_funcs

    (tmp_path / "broken_reward_pkg.py").write_text(
        "import json\n\nclass BrokenReward:\n    def __init__(self):\n        json.loads('{bad')\n"
        "    def __call__(self, completions, **kwargs):\n        return [0.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(json.JSONDecodeError) as info:
        resolve_reward_funcs(["broken_reward_pkg.BrokenReward"])
    assert not is_user_error(info.value, training_started=False)
