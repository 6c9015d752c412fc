"""Checkpoints of a ``grpo fit`` run: where they go, which to resume from, which run they continue.

Layer L6. A run folder (``trainer.default_root_dir``) holds one run, so it also holds its
checkpoints in one stable place, ``<root>/checkpoints`` (Lightning's default, under the MLflow
logger, is a new ``<experiment>/<run>/checkpoints`` folder per resume), and ``run.json`` naming the
MLflow run, so that a resumed run logs into the same MLflow run instead of opening a new one.

By default a run keeps the last ``keep_checkpoints`` periodic checkpoints (every
``checkpoint_every_n_steps`` optimizer steps; ``last.ckpt`` links to the newest) plus one written
when training fails with an exception: a crash loses at most that many steps, and a 7B run's
disk use stays bounded. ``--ckpt_path last`` resumes from the newest complete checkpoint there
(the one of the highest step).
"""

from __future__ import annotations

import json
import logging
import os
import re
import zipfile
from typing import Any

import lightning.pytorch as pl

from grpo_lightning.errors import ConfigError

log = logging.getLogger(__name__)
CHECKPOINT_DIR = "checkpoints"
RUN_RECORD = "run.json"
EXCEPTION_CHECKPOINT = "on_exception"
_STEP_IN_NAME = re.compile(r"step=(\d+)")
_LAST_LINK = re.compile(r"last(-v\d+)?\.ckpt")  # Lightning's link to the newest (versioned by older releases)


def checkpoint_dir(root_dir: str) -> str:
    return os.path.join(os.path.abspath(root_dir), CHECKPOINT_DIR)


#: The file name of the periodic checkpoints (``checkpoint_every_n_steps``).
PERIODIC_FILENAME = "step={step:07d}"


def is_periodic_checkpoint(callback: Any) -> bool:
    """Whether ``callback`` is the run's every-``checkpoint_every_n_steps`` ``ModelCheckpoint``."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    return isinstance(callback, ModelCheckpoint) and callback.filename == PERIODIC_FILENAME and callback.monitor == "step"


def default_checkpoints(root_dir: str, every_n_steps: int, keep: int) -> list[Any]:
    """A ``ModelCheckpoint`` keeping the ``keep`` newest of its every-``every_n_steps`` checkpoints
    (``last.ckpt`` links to the newest; written again after a validation that follows,
    ``periodic_checkpoint.py``), and an ``OnExceptionCheckpoint``, both in the run's folder."""
    from grpo_lightning.cli.periodic_checkpoint import PeriodicCheckpoint

    if every_n_steps < 1 or keep < 1:
        raise ConfigError(f"checkpoint_every_n_steps={every_n_steps}, keep_checkpoints={keep}: both must be >= 1 "
                          "(trainer.enable_checkpointing: false turns checkpoints off).")
    folder = checkpoint_dir(root_dir)
    # monitor="step" (always a candidate) with mode max keeps the newest: top-k of the step number.
    periodic = PeriodicCheckpoint(dirpath=folder, filename=PERIODIC_FILENAME, auto_insert_metric_name=False,
                                  every_n_train_steps=every_n_steps, save_top_k=keep, monitor="step", mode="max",
                                  save_last="link", enable_version_counter=False)  # a resume re-links last.ckpt
    return [periodic, CheckpointOnException(os.path.join(folder, EXCEPTION_CHECKPOINT + ".ckpt"))]


class CheckpointOnException(pl.Callback):
    """Writes a checkpoint when training fails with an exception (single-process runs).

    Not Lightning's ``OnExceptionCheckpoint``: its presence makes every ``fit`` without a
    ``ckpt_path`` resume silently from the newest checkpoint; here resuming is always asked for
    (``--ckpt_path last``). Under several processes nothing is written: a checkpoint needs every
    rank, and a failing rank cannot count on the others (the periodic checkpoints cover them).
    Nor is anything written for a failure inside an optimizer update, from its closure's end (the
    gradients complete: ``on_before_optimizer_step``) to the step's end: the optimizer state and
    the weights are half-updated there (AdamW moves its step counts and moments before its largest
    allocation), and a resume would apply the step twice.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._update_at: int | None = None  # Lightning's count of optimizer steps begun when an update began

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self._update_at = _optimizer_steps(trainer).ready

    def _inside_update(self, trainer: pl.Trainer) -> bool:
        steps = _optimizer_steps(trainer)  # ready: optimizer_step entered; completed: it returned
        return steps.ready > steps.completed and self._update_at == steps.ready

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if trainer.world_size > 1 or trainer.global_step == 0:
            return
        if getattr(pl_module, "optimizer_state_released", False):  # failed after training ended: nothing to resume
            log.warning("Failed after training ended (%s); no checkpoint written", type(exception).__name__)
            return
        if self._inside_update(trainer):
            log.warning("Training failed inside an optimizer update (%s): the optimizer state and the weights are "
                        "half-updated, so no checkpoint is written; resume from the last periodic one "
                        "(--ckpt_path last)", type(exception).__name__)
            return
        log.warning("Training failed (%s); writing %s", type(exception).__name__, self.path)
        trainer.save_checkpoint(self.path)


def _optimizer_steps(trainer: pl.Trainer) -> Any:
    """Lightning's progress counters of the optimizer steps (automatic optimization)."""
    return trainer.fit_loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total


def place_checkpoints(callbacks: list[Any], root_dir: str, every_n_steps: int, keep: int) -> list[Any]:
    """``callbacks`` with the run's checkpoints: the configured ``ModelCheckpoint``s write into
    ``<root>/checkpoints`` unless they name a folder; with none configured, the defaults are added."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    configured = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    for callback in configured:
        if callback.dirpath is None:
            callback.dirpath = checkpoint_dir(root_dir)
    return callbacks if configured else [*callbacks, *default_checkpoints(root_dir, every_n_steps, keep)]


def is_complete(path: str) -> bool:
    """Whether a checkpoint was written whole: a file is a zip whose central directory (written
    last) is readable; a distributed-checkpoint folder has its ``.metadata`` (written last)."""
    if os.path.isdir(path):
        return os.path.isfile(os.path.join(path, ".metadata"))
    try:
        with zipfile.ZipFile(path):
            return True
    except (OSError, zipfile.BadZipFile):
        return False


def checkpoint_step(path: str) -> int:
    """The optimizer step a checkpoint was written at: from a ``step=N`` name, else its
    ``global_step`` (read memory-mapped, no tensor is loaded); -1 when neither can be read."""
    found = _STEP_IN_NAME.search(os.path.basename(path))
    if found:
        return int(found.group(1))
    if not os.path.isfile(path):
        return -1
    try:
        import torch

        return int(torch.load(path, map_location="cpu", mmap=True, weights_only=False)["global_step"])
    except Exception:  # not a checkpoint Lightning wrote: ordered by write time alone
        return -1


def _candidates(folder: str) -> list[str]:
    """Checkpoints in ``folder``, newest first: by the step they were written at, then by write
    time (a copied run folder's times say nothing; ``last.ckpt`` links to one of them)."""
    if not os.path.isdir(folder):
        return []
    paths = [os.path.join(folder, name) for name in os.listdir(folder)
             if not _LAST_LINK.fullmatch(name) and (name.endswith(".ckpt") or os.path.isdir(os.path.join(folder, name)))]
    return sorted(paths, key=lambda p: (checkpoint_step(p), os.path.getmtime(p)), reverse=True)


def resolve_ckpt_path(ckpt_path: str | None, root_dir: str) -> str | None:
    """The checkpoint file a ``--ckpt_path`` resumes from.

    ``last``: the newest complete checkpoint in ``<root>/checkpoints`` (an error naming the folder
    when there is none, instead of Lightning's silent fresh start). A path: that file, or, when it
    was left half-written (a run killed while saving), the newest complete one beside it, with a
    warning. Other values (``best``, ``hpc``, ``registry:...``) are Lightning's.
    """
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        folder = checkpoint_dir(root_dir)
        found = [p for p in _candidates(folder) if is_complete(p)]
        if not found:
            raise ConfigError(
                f"--ckpt_path last: no complete checkpoint in {folder}. Resume with --ckpt_path <file>, or check "
                "trainer.default_root_dir (it must be the folder of the run to resume).")
        return found[0]
    if ckpt_path in ("best", "hpc") or ckpt_path.startswith("registry"):
        return ckpt_path
    if not os.path.exists(ckpt_path):
        raise ConfigError(f"--ckpt_path {ckpt_path}: no such checkpoint. Give an existing file, or last.")
    if is_complete(ckpt_path):
        return ckpt_path
    folder = os.path.dirname(os.path.abspath(ckpt_path))
    previous = [p for p in _candidates(folder) if is_complete(p) and os.path.realpath(p) != os.path.realpath(ckpt_path)]
    if not previous:
        raise ConfigError(f"--ckpt_path {ckpt_path} is incomplete (the run was stopped while writing it) and no "
                          f"complete checkpoint is beside it in {folder}.")
    log.warning("Checkpoint %s is incomplete (the run was stopped while writing it); resuming from %s, the newest "
                "complete one.", ckpt_path, previous[0])
    return previous[0]


def forget_previous_run(root_dir: str) -> None:
    """On ``--overwrite_run_dir``: drop the previous run's checkpoints and run record, so that
    ``--ckpt_path last`` can never resume the run that was written over (called on rank 0 only)."""
    import shutil

    shutil.rmtree(checkpoint_dir(root_dir), ignore_errors=True)
    record = os.path.join(root_dir, RUN_RECORD)
    if os.path.isfile(record):
        os.remove(record)


def write_run_record(root_dir: str, mlflow_run_id: str, tracking_uri: str, experiment_name: str) -> None:
    """``<root>/run.json``: the MLflow run this folder's run logs to."""
    os.makedirs(root_dir, exist_ok=True)
    record = {"mlflow_run_id": mlflow_run_id, "tracking_uri": tracking_uri, "experiment_name": experiment_name}
    tmp = os.path.join(root_dir, RUN_RECORD + ".tmp")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(root_dir, RUN_RECORD))


def read_run_record(root_dir: str) -> dict[str, str] | None:
    path = os.path.join(root_dir, RUN_RECORD)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return json.load(f)


def continue_recorded_run(loggers: list[Any], record: dict[str, str] | None) -> None:
    """A resume continues the MLflow run of ``record`` (``run.json``) in a configured
    ``MLFlowLogger`` too (``trainer.logger`` in the YAML): one that logs to the same store and
    experiment and names no run of its own, which would otherwise start a second run."""
    if not record:
        return
    from lightning.pytorch.loggers import MLFlowLogger

    for logger in loggers:
        if (isinstance(logger, MLFlowLogger) and logger._run_id is None
                and logger._tracking_uri == record.get("tracking_uri")
                and logger._experiment_name == record.get("experiment_name")):
            logger._run_id = record["mlflow_run_id"]  # as MLFlowLogger(run_id=...) sets it


__all__ = [
    "CHECKPOINT_DIR", "CheckpointOnException", "checkpoint_dir", "continue_recorded_run", "default_checkpoints",
    "forget_previous_run", "is_complete", "place_checkpoints", "read_run_record", "resolve_ckpt_path",
    "write_run_record",
]
