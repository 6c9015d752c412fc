"""Shared pytest fixtures."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent

# Let a plain `pytest` from a checkout work without `pip install -e .`.
if importlib.util.find_spec("grpo_lightning") is None:
    sys.path.insert(0, str(REPO_ROOT))


@pytest.fixture(scope="session")
def shared_assets() -> Path:
    """Folder of offline test assets (tokenizers, datasets, a tiny model).

    Taken from ``$GRPO_SHARED_ASSETS``, default ``<repo>/../shared/assets``; tests using it are
    skipped with the reason when it is absent (they never download anything).
    """
    root = Path(os.environ.get("GRPO_SHARED_ASSETS", REPO_ROOT.parent / "shared" / "assets"))
    if not root.is_dir():
        pytest.skip(
            f"shared test assets not found at {root}: set GRPO_SHARED_ASSETS to the folder that "
            "holds tokenizers/ and datasets/ to run this test"
        )
    return root
