"""Fixtures of the TRL-facade tests: a tiny model folder, tiny prompt datasets, a run folder."""

from __future__ import annotations

import pytest

from tests.helpers import make_model_dir


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A 2-layer Llama of ~20K parameters with its character tokenizer, saved to a folder."""
    return make_model_dir(tmp_path_factory.mktemp("trl_model") / "model")


@pytest.fixture()
def prompts():
    """16 plain-text prompts with an ``answer`` column."""
    import datasets

    return datasets.Dataset.from_list([{"prompt": f"{i % 10}+{(3 * i) % 10}=", "answer": str(i % 10 + (3 * i) % 10)}
                                       for i in range(16)])


@pytest.fixture(autouse=True)
def _single_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
