"""Model and tokenizer paths are checked when GRPOModule is built, with errors naming the setting."""

from __future__ import annotations

import shutil

import pytest

from grpo_lightning.errors import ConfigError
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.model_loading import check_model_sources
from tests.helpers import make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("sources") / "model")


def test_a_mistyped_path_says_it_does_not_exist(tmp_path):
    # transformers said "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"
    with pytest.raises(ConfigError, match=r"model\.model=.*examples/arithmetic/modle.*no such folder"):
        GRPOModule("examples/arithmetic/modle")
    (tmp_path / "runs").mkdir()
    with pytest.raises(ConfigError, match="no such folder"):  # `runs/typo` reads as a hub id, but runs/ is local
        check_model_sources(str(tmp_path / "runs" / "typo"))


def test_a_model_folder_without_tokenizer_names_model_tokenizer(model_dir, tmp_path):
    weights_only = tmp_path / "weights_only"
    shutil.copytree(model_dir, weights_only)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (weights_only / name).unlink()
    with pytest.raises(ConfigError, match=r"model\.tokenizer"):
        GRPOModule(str(weights_only))
    check_model_sources(str(weights_only), tokenizer=model_dir)  # a tokenizer from elsewhere is fine
    with pytest.raises(ConfigError, match=r"model\.tokenizer=.*holds no tokenizer files"):
        check_model_sources(model_dir, tokenizer=str(weights_only))
    with pytest.raises(ConfigError, match=r"model\.tokenizer=.*no such folder"):
        check_model_sources(model_dir, tokenizer=str(tmp_path / "nope" / "tok"))


def test_hub_ids_and_model_objects_pass_without_network(model_dir):
    check_model_sources("Qwen/Qwen2.5-0.5B-Instruct")
    check_model_sources("gpt2", tokenizer="org/tokenizer")
    check_model_sources(object())  # an instantiated model: nothing to check
    check_model_sources(model_dir)
