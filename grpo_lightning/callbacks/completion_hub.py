"""Pushing the logged completions to a Hugging Face Hub dataset (``log_completions_hub_repo``).

Like TRL, the dataset is the run's ``completions/completions_<step>.parquet`` files: the repository
is created (``exist_ok``) before the first step, so a missing login fails before any compute, and
every push uploads all rows logged so far (every step, every completion: ``log_unique_prompts``
does not thin it) as the ``train`` split of a :class:`datasets.Dataset`. Pushes happen at logging
steps at most every ``push_interval_s`` seconds (TRL's background scheduler commits every 2
minutes) and once more when fit ends, successful or not. A push that fails (network) is logged
and retried at the next logging step; training goes on.
"""

from __future__ import annotations

import glob
import logging
import os
import time
from typing import Any

log = logging.getLogger(__name__)

SETTING = "CompletionLogger.log_completions_hub_repo"


class CompletionHub:
    """One run's completions dataset on the Hub.

    Args:
        repo_id: ``user/name``, ``org/name`` or ``name`` (created in the logged-in user's namespace).
        private: Create the repository private (``None``: the Hub's default, public for users).
        push_interval_s: Least seconds between two pushes at logging steps (``0``: every one).
    """

    def __init__(self, repo_id: str, private: bool | None = None, push_interval_s: float = 120.0) -> None:
        if not isinstance(repo_id, str) or not repo_id.strip() or repo_id.count("/") > 1:
            raise ValueError(f"{SETTING}={repo_id!r}: give a Hub dataset repository 'user/name', 'org/name' or 'name'.")
        if push_interval_s < 0:
            raise ValueError(f"CompletionLogger.hub_push_interval_s={push_interval_s}: use 0 or more seconds.")
        self.repo_id = repo_id.strip()
        self.private = private
        self.push_interval_s = push_interval_s
        self._last_push: float | None = None
        self._pending_step: int | None = None  # newest logged step not pushed yet

    def create(self) -> str:
        """Create the dataset repository if needed (rank 0, before training) and return its full id."""
        from huggingface_hub import create_repo

        try:
            url = create_repo(self.repo_id, repo_type="dataset", private=self.private, exist_ok=True)
        except Exception as err:
            if hasattr(err, "add_note"):
                err.add_note(f"(while creating the dataset repository {SETTING}={self.repo_id!r}: log in with "
                             "`hf auth login` or set HF_TOKEN, or remove the setting)")
            raise
        self.repo_id = getattr(url, "repo_id", None) or self.repo_id
        return self.repo_id

    def logged(self, folder: str, step: int, final: bool = False) -> None:
        """Note that ``step`` was written to ``folder``; push if the interval has passed (or ``final``)."""
        self._pending_step = step
        due = self._last_push is None or time.monotonic() - self._last_push >= self.push_interval_s
        if final or due:
            self.flush(folder)

    def flush(self, folder: str) -> None:
        """Push every ``completions_*.parquet`` of ``folder`` if some step has not been pushed yet."""
        if self._pending_step is None:
            return
        step = self._pending_step
        try:
            dataset = completions_dataset(folder)
            dataset.push_to_hub(self.repo_id, private=self.private, commit_message=f"Completions up to step {step}")
        except Exception as err:  # noqa: BLE001 - the run must not die for a network error
            log.warning("pushing the completions to the Hub dataset %r failed (%s: %s); retrying at the next "
                        "logging step.", self.repo_id, type(err).__name__, err)
            return
        self._pending_step = None
        self._last_push = time.monotonic()


def completions_dataset(folder: str) -> Any:
    """All ``completions_<step>.parquet`` files of ``folder``, in step order, as one ``datasets.Dataset``
    (columns a step lacks, e.g. a ``log_extra`` column added later, are null there)."""
    import datasets
    import pandas as pd

    files = sorted(glob.glob(os.path.join(folder, "completions_*.parquet")))
    if not files:
        raise FileNotFoundError(f"no completions_*.parquet files in {folder}")
    frame = pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    return datasets.Dataset.from_pandas(frame, preserve_index=False)
