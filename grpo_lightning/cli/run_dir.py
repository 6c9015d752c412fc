"""One run per run folder: ``grpo fit`` refuses a ``default_root_dir`` that holds another run.

A second run into the same folder would overwrite ``final_model/``, ``config.yaml`` and the
completion tables of the first while keeping its checkpoints, leaving a folder that mixes two runs.
Resuming from a checkpoint (``--ckpt_path``) continues the run that is there, so it is allowed, as
is an explicit ``--overwrite_run_dir true``.
"""

from __future__ import annotations

import os

from grpo_lightning.errors import ConfigError

#: What a run that started training leaves in its folder: its config (written when training starts),
#: the export, completion tables, checkpoints. Not ``mlflow.db``: the MLflow store holds any number of
#: runs, and a run that failed before training (a typo in the config) may already have created it.
RUN_MARKERS = ("config.yaml", "final_model", "completions", "checkpoints")
#: ``ckpt_path`` values that Lightning resolves itself (they point into the current run).
_SPECIAL_CKPT_PATHS = ("last", "hpc", "best")


def previous_run_files(*folders: str | None) -> list[str]:
    """The run markers present in ``folders`` (paths as found, in a stable order)."""
    found: list[str] = []
    for folder in dict.fromkeys(os.path.abspath(f) for f in folders if f):
        found += [os.path.join(folder, name) for name in RUN_MARKERS if os.path.exists(os.path.join(folder, name))]
    return found


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return os.path.commonpath([path, folder]) == folder


def check_run_dir(root_dir: str, ckpt_path: str | None, overwrite: bool, output_dir: str | None = None) -> None:
    """Raise :class:`ConfigError` when ``root_dir`` (or ``output_dir``) already holds another run.

    Allowed: an empty or new folder, ``overwrite``, or resuming from a checkpoint of the run in
    ``root_dir`` (a path inside it, or ``last``/``hpc``/``best``).
    """
    if overwrite:
        return
    found = previous_run_files(root_dir, output_dir)
    if not found:
        return
    if ckpt_path is not None:
        if ckpt_path in _SPECIAL_CKPT_PATHS or ckpt_path.startswith("registry") or _inside(ckpt_path, root_dir):
            return
        raise ConfigError(
            f"trainer.default_root_dir={root_dir!r} already holds a run ({', '.join(found)}), and "
            f"ckpt_path={ckpt_path!r} is a checkpoint of another folder: resuming it here would mix two runs. "
            "Resume into the checkpoint's own run folder, set trainer.default_root_dir to a new folder, or pass "
            "--overwrite_run_dir true to write over this one."
        )
    raise ConfigError(
        f"trainer.default_root_dir={root_dir!r} already holds a run ({', '.join(found)}); a new run would "
        "overwrite its files and mix the two. Set trainer.default_root_dir to a new folder, resume that run with "
        "--ckpt_path <its checkpoint> (or --ckpt_path last), or pass --overwrite_run_dir true to write over it."
    )
