"""Hugging Face ``TrainerCallback``s in a Lightning run, and TRL's ``log_history``.

``TrainerCallbacks`` is a Lightning callback that keeps ``log_history`` (one dict per logging step,
with ``step``, as ``Trainer.state.log_history``) and calls the HF callbacks it holds at the Lightning
hooks that match their events (``EVENTS``), with a ``transformers.TrainerState`` kept current and a
``TrainerControl`` whose ``should_training_stop`` stops the run (``trainer.should_stop``). A callback
that implements an event without a Lightning equivalent (``UNSUPPORTED``) is refused before
training, naming the event. ``add_callback`` / ``pop_callback`` / ``remove_callback`` change the list
as transformers' ``CallbackHandler`` does; ``log_logs`` is transformers' ``Trainer.log``; the
end-of-training summary is transformers' (``run_state``).

In YAML (``grpo fit``)::

    trainer:
      callbacks:
        - class_path: grpo_lightning.trl_compat.callbacks.TrainerCallbacks
          init_args: {callbacks: [my_pkg.callbacks.MyCallback], args: {logging_steps: 1}}

Layer L7 (trl_compat).
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers.logger import Logger

from grpo_lightning.errors import ConfigError
from grpo_lightning.module.step_logging import FlushStepLogs, fractional_epoch
from grpo_lightning.rewards.loading import import_dotted_path
from grpo_lightning.trl_compat import run_state

log = logging.getLogger(__name__)

#: HF event -> the Lightning moment it is called at.
EVENTS = {
    "on_init_end": "setup (once, before training or evaluation starts)",
    "on_train_begin": "on_train_start",
    "on_train_end": "on_train_end",
    "on_epoch_begin": "on_train_epoch_start",
    "on_epoch_end": "on_train_epoch_end",
    "on_step_begin": "on_train_batch_start of an optimizer step's first micro-batch",
    "on_substep_end": "on_train_batch_end of a micro-batch that does not end an optimizer step",
    "on_optimizer_step": "on_train_batch_end of the micro-batch that ends an optimizer step, before on_step_end: the "
                         "gradients the step applied are still there (the module drops them after every callback)",
    "on_step_end": "on_train_batch_end of the micro-batch that ends an optimizer step",
    "on_log": "each time the step (or evaluation) metrics are logged, with logs= those metrics",
    "on_evaluate": "on_validation_end, with metrics= the evaluation's eval_* metrics",
    "on_save": "on_save_checkpoint (while a checkpoint is written)",
    "on_push_begin": "GRPOTrainer.push_to_hub, before the upload",
}
UNSUPPORTED = {
    "on_pre_optimizer_step": "Lightning clips gradients after its last hook before the optimizer step, so nothing "
                             "runs where HF calls it (after clipping)",
    "on_predict": "there is no prediction loop (evaluation generates and scores: on_evaluate)",
    "on_prediction_step": "there is no prediction loop (evaluation generates and scores: on_evaluate)",
}
#: Step-log keys transformers' own step log adds, which TRL's metrics window does not hold: TRL's
#: end-of-training summary (which takes in the window since the last log) has none of them.
NOT_IN_TRL_WINDOW = ("loss", "grad_norm", "learning_rate")


def implemented_events(callback: Any) -> list[str]:
    """The ``on_*`` events ``callback`` (an instance or a class) implements itself."""
    cls = callback if inspect.isclass(callback) else type(callback)
    base = _hf_base()
    events = []
    for name in (*EVENTS, *UNSUPPORTED):
        method = getattr(cls, name, None)
        if method is not None and (base is None or not issubclass(cls, base) or method is not getattr(base, name)):
            events.append(name)
    return events


def _hf_base() -> Any:
    try:
        from transformers.trainer_callback import TrainerCallback
    except ImportError:  # pragma: no cover - transformers is a dependency
        return None
    return TrainerCallback


def check_callback(callback: Any, where: str) -> None:
    """Refuse a callback that implements an event with no Lightning equivalent."""
    bad = [e for e in implemented_events(callback) if e in UNSUPPORTED]
    if bad:
        name = getattr(callback, "__name__", type(callback).__name__)
        reasons = "; ".join(f"{e}: {UNSUPPORTED[e]}" for e in bad)
        raise ConfigError(f"{where} ({name}) implements {', '.join(bad)}, which grpo-lightning cannot call ({reasons}). "
                          f"Supported events: {', '.join(EVENTS)}; or write a Lightning callback.")


class _Recorder(Logger):
    """A logger that hands every ``log_metrics`` call to its callback (added to ``trainer.loggers``)."""

    def __init__(self, owner: "TrainerCallbacks") -> None:
        super().__init__()
        self.owner = owner

    @property
    def name(self) -> str:
        return "log_history"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.owner.record(metrics, step)


class TrainerCallbacks(pl.Callback):
    """TRL's ``log_history`` and Hugging Face ``TrainerCallback``s in a Lightning run.

    Args:
        callbacks: HF callbacks: dotted paths of classes (built without arguments), classes, or
            instances (from Python). Each event it implements is called at the matching Lightning
            hook (see ``grpo_lightning.trl_compat.callbacks.EVENTS``).
        args: ``GRPOConfig`` fields (those that differ from the defaults) for the ``args`` the
            callbacks receive.
    """

    def __init__(self, callbacks: list[Any] | None = None, args: dict[str, Any] | None = None) -> None:
        from transformers.trainer_callback import TrainerControl, TrainerState

        from grpo_lightning.trl_compat.config import GRPOConfig

        self._from_class: set[int] = set()  # ids of the callbacks built here from a class (YAML names the class)
        self.callbacks = [self._build(c, i) for i, c in enumerate(callbacks or [])]
        self.args = args if isinstance(args, GRPOConfig) else GRPOConfig(**(args or {}))
        #: One dict per log: the logged metrics, ``epoch`` and ``step`` (HF's ``state.log_history``).
        self.log_history: list[dict[str, Any]] = []
        self.step_losses: list[float] = []
        # Always there, callbacks or not: GRPOTrainer.state is this object (its log_history is ours).
        self.state: Any = TrainerState(log_history=self.log_history)
        self.control: Any = TrainerControl()
        #: The end-of-training summary of the last ``fit`` (``TrainOutput.metrics`` plus ``step``).
        self.train_summary: dict[str, Any] = {}
        self._trainer: Any = None
        self._module: Any = None
        self._initialised = False
        self._step_open = False
        self._last_step = -1
        self._epoch = 0.0  # fractional, as transformers counts: epochs done + this epoch's share of batches
        self._eval_logs: dict[str, float] = {}
        self._started = 0.0
        self._first_step = 0
        self._max_steps: int | None = None
        self._num_train_epochs: int | float | None = None
        self._num_train_samples = 0.0
        self._warned: set[str] = set()

    def _build(self, callback: Any, i: int) -> Any:
        if isinstance(callback, str):
            callback = import_dotted_path(callback)
        check_callback(callback, f"callbacks[{i}]")
        if not inspect.isclass(callback):
            return callback
        built = callback()
        self._from_class.add(id(built))
        return built

    # ------------------------------------------------------------------ the callback list (transformers' semantics)
    def add_callback(self, callback: Any) -> None:
        """Add a callback (a class is built without arguments), refusing unsupported events as the
        constructor does; a second one of a class already there is added with a warning, as in HF."""
        built = self._build(callback, len(self.callbacks))
        if type(built) in {type(c) for c in self.callbacks}:
            log.warning("You are adding a %s to the callbacks, but there is already one. The current list of "
                        "callbacks is: %s", type(built).__name__, ", ".join(type(c).__name__ for c in self.callbacks))
        self.callbacks.append(built)

    def pop_callback(self, callback: Any) -> Any:
        """Remove and return the first callback of class ``callback`` (or that instance); ``None`` if
        there is none."""
        for existing in self.callbacks:
            if isinstance(existing, callback) if inspect.isclass(callback) else existing == callback:
                self.callbacks.remove(existing)
                self._from_class.discard(id(existing))
                return existing
        return None

    def remove_callback(self, callback: Any) -> None:
        """Remove the first callback of class ``callback``, or that instance (``ValueError`` when the
        instance is not there, as ``list.remove`` raises in HF)."""
        if inspect.isclass(callback):
            self.pop_callback(callback)
            return
        self.callbacks.remove(callback)
        self._from_class.discard(id(callback))

    def sources(self) -> list[Any]:
        """Each callback as it is written to YAML: its class where it was given as a class, else the instance."""
        return [type(c) if id(c) in self._from_class else c for c in self.callbacks]

    @property
    def state_key(self) -> str:
        return "TrainerCallbacks"

    # ------------------------------------------------------------------ Lightning hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer, self._module = trainer, pl_module
        if not any(isinstance(lg, _Recorder) for lg in trainer.loggers):
            trainer.loggers = [*trainer.loggers, _Recorder(self)]
        if not self._initialised:
            self._initialised = True
            self._fire("on_init_end")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._started = time.time()  # speed_metrics measures wall-clock time from here
        self._last_step = self._first_step = trainer.global_step
        self._epoch = fractional_epoch(trainer, trainer.fit_loop.epoch_loop.batch_idx)  # a resumed run's, as HF restores it
        # The run's length as transformers works it out before its first step (epochs: the steps they amount to).
        self._max_steps = run_state.planned_steps(trainer)
        self._num_train_epochs = run_state.num_train_epochs(trainer, self.args, self._max_steps)
        self._num_train_samples = run_state.num_train_samples(trainer, self.args, self._max_steps)
        self.control.should_training_stop = False  # as HF's CallbackHandler.on_train_begin
        self._fire("on_train_begin")

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fire("on_epoch_begin")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._step_open:
            self._step_open = True
            self._fire("on_step_begin")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._epoch = fractional_epoch(trainer, batch_idx)
        if trainer.global_step == self._last_step:
            self._fire("on_substep_end")
            return
        self._last_step, self._step_open = trainer.global_step, False
        loss = (getattr(pl_module, "step_metrics", None) or {}).get("loss")
        if loss is not None:
            self.step_losses.append(float(loss))
        self._fire("on_optimizer_step", step_offset=-1)  # as HF: before global_step counts the step
        self._fire("on_step_end")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._fire("on_epoch_end")

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_logs = {}

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and self._eval_logs:
            self._fire("on_evaluate", metrics=dict(self._eval_logs))

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._fire("on_save")

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # transformers' _finalize_training: the summary goes through Trainer.log (log_history, on_log),
        # then on_train_end.
        loss = sum(self.step_losses) / len(self.step_losses) if self.step_losses else float("nan")
        summary = run_state.train_summary(self._started, trainer.global_step - self._first_step, self._max_steps,
                                          self._num_train_samples, loss)
        summary.update(self._unlogged_window(trainer))
        self.log_logs(summary)
        self.train_summary = self.log_history[-1]
        self._fire("on_train_end")

    @staticmethod
    def _unlogged_window(trainer: pl.Trainer) -> dict[str, float]:
        """The metrics gathered since the last step log (the steps after the last multiple of
        ``logging_steps``), which TRL's ``log`` puts into the summary: TRL averages its metrics
        window into every log, the summary included. Empty when the run ended on a log."""
        for callback in trainer.callbacks:
            if isinstance(callback, FlushStepLogs) and callback.metrics:
                window = callback.metrics.flush_log()
                return {k: v for k, v in window.items() if k not in NOT_IN_TRL_WINDOW}
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"log_history": list(self.log_history), "step_losses": list(self.step_losses)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.log_history[:] = state_dict.get("log_history", [])
        self.step_losses[:] = state_dict.get("step_losses", [])

    # ------------------------------------------------------------------ logs
    @property
    def epoch(self) -> float:
        return float(self._epoch)

    def log_logs(self, logs: dict[str, float]) -> None:
        """transformers' ``Trainer.log``: ``logs`` (with ``epoch`` added, when known) appended to
        ``log_history`` with ``step``, and ``on_log`` called with it. (Not named ``log``: Lightning
        sets every callback's ``log`` to the module's ``log`` when a run starts.)"""
        self._sync_state()
        if self.state.epoch is not None:
            logs["epoch"] = self.state.epoch
        self.log_history.append({**logs, "step": self.state.global_step})
        self._fire("on_log", logs=logs)
        self._to_loggers(logs)

    def _to_loggers(self, logs: dict[str, Any]) -> None:
        """The numbers of ``logs`` to the run's Lightning loggers (MLflow, ...) at the current step, as
        transformers' reporting callbacks log every ``Trainer.log``: while a run is going (its end's
        summary included); before or after one there is no open run to log to."""
        trainer = self._trainer
        if trainer is None or trainer.state.status.value != "running" or trainer.sanity_checking:
            return
        numbers = {k: float(v) for k, v in logs.items()
                   if k != "epoch" and isinstance(v, (int, float)) and not isinstance(v, bool)}  # epoch: every step log has it
        for logger in trainer.loggers:
            if not isinstance(logger, _Recorder):  # the recorder is how step logs reach log_history
                logger.log_metrics(numbers, step=trainer.global_step)

    def record(self, metrics: dict[str, float], step: int | None) -> None:
        """One ``log_metrics`` call: appended to ``log_history``; ``on_log`` is called with it."""
        trainer = self._trainer
        if trainer is not None and trainer.sanity_checking:
            return
        logs = {k: float(v) for k, v in metrics.items()}
        if any(k.startswith("eval_") for k in logs):
            self._eval_logs.update(logs)
        logs["epoch"] = self.epoch  # transformers' fractional epoch (also what the loggers get)
        self.log_history.append({**logs, "step": int(step if step is not None else trainer.global_step)})
        self._fire("on_log", logs=logs)

    # ------------------------------------------------------------------ HF events
    def _fire(self, event: str, step_offset: int = 0, **kwargs: Any) -> None:
        self._sync_state(step_offset)  # trainer.state is kept current with or without callbacks
        if not self.callbacks:
            return
        extra = self._objects()
        for callback in self.callbacks:
            handler = getattr(callback, event, None)
            if handler is None:
                continue
            result = handler(self.args, self.state, self.control, **extra, **kwargs)
            if result is not None:
                self.control = result
        self._apply_control(event)

    def push_begin(self) -> None:
        """``on_push_begin`` (called by ``GRPOTrainer.push_to_hub``)."""
        self._fire("on_push_begin")

    def _sync_state(self, step_offset: int = 0) -> None:
        state, trainer, args = self.state, self._trainer, self.args
        if trainer is not None and self._max_steps is None and trainer.max_steps and trainer.max_steps > 0:
            self._max_steps = trainer.max_steps  # before training (on_init_end): what max_steps says
        if self._max_steps is not None:
            state.max_steps = self._max_steps
        state.logging_steps, state.eval_steps, state.save_steps = (
            run_state.absolute_steps(v, self._max_steps) for v in (args.logging_steps, args.eval_steps, args.save_steps))
        state.train_batch_size = args.per_device_train_batch_size
        state.num_train_epochs = self._num_train_epochs if self._num_train_epochs is not None else args.num_train_epochs
        if trainer is None:
            return
        state.global_step, state.epoch = trainer.global_step + step_offset, self.epoch
        state.is_world_process_zero = trainer.is_global_zero
        state.is_local_process_zero = trainer.local_rank == 0

    def _objects(self) -> dict[str, Any]:
        module, trainer = self._module, self._trainer
        out: dict[str, Any] = {}
        if module is not None:
            try:
                out["model"] = module.policy
            except RuntimeError:  # not built yet (on_init_end comes before configure_model)
                out["model"] = None
            out["processing_class"] = getattr(module, "tokenizer", None)
        if trainer is not None and trainer.optimizers:
            out["optimizer"] = trainer.optimizers[0]
            configs = trainer.lr_scheduler_configs
            out["lr_scheduler"] = configs[0].scheduler if configs else None
        return out

    def _apply_control(self, event: str) -> None:
        control = self.control
        if control.should_training_stop and self._trainer is not None:
            self._trainer.should_stop = True
        for flag in ("should_epoch_stop", "should_save", "should_evaluate", "should_log"):
            if getattr(control, flag):
                setattr(control, flag, False)
                if flag not in self._warned:
                    self._warned.add(flag)
                    log.warning("A TrainerCallback set control.%s in %s: it has no effect here (only "
                                "should_training_stop does; saving, evaluating and logging follow the settings).",
                                flag, event)
