"""``grpo``: the command line (LightningCLI over ``GRPOModule`` and ``RolloutDataModule``).

    grpo fit --config configs/quickstart.yaml
    grpo fit --config cfg.yaml --model.learning_rate 1e-5 --trainer.max_steps 100
    grpo fit --config cfg.yaml --print_config
    grpo plot runs/quickstart            # the run's curves from its MLflow store (cli.plot)

With no logger configured, runs log to MLflow in a sqlite store under the run folder
(``<trainer.default_root_dir>/mlflow.db``); any Lightning logger can be configured instead.
A run folder holds one run: ``grpo fit`` refuses one that holds another run unless resuming
(``--ckpt_path``) or told ``--overwrite_run_dir true``. A user error (a bad setting, file or data)
prints one message; ``GRPO_DEBUG=1`` shows the full traceback (rule: ``grpo_lightning.errors``).
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from contextvars import ContextVar
from typing import Any

from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

from grpo_lightning.cli.checkpoints import (
    continue_recorded_run, forget_previous_run, place_checkpoints, read_run_record, resolve_ckpt_path, write_run_record,
)
from grpo_lightning.cli.devices import check_accelerator
from grpo_lightning.cli.error_context import component_key, with_setting
from grpo_lightning.cli.parser import COMPONENTS, GRPOArgumentParser, expand_component_names
from grpo_lightning.cli.run_dir import check_run_dir
from grpo_lightning.data import RolloutDataModule
from grpo_lightning.data.run_summary import check_trainer_settings
from grpo_lightning.errors import DEBUG_ENV, debug_enabled, find_user_error, user_message
from grpo_lightning.module import GRPOModule


# TRL's defaults where Lightning's differ: max_grad_norm=1.0, logging_steps=10, no sanity-check generation.
TRAINER_DEFAULTS: dict[str, Any] = {"gradient_clip_val": 1.0, "log_every_n_steps": 10, "num_sanity_val_steps": 0}
MLFLOW_LOGGER = "lightning.pytorch.loggers.MLFlowLogger"
EPILOG = (
    f"A bad setting, file or data prints one error message; set {DEBUG_ENV}=1 to see the full traceback. "
    "A run folder (trainer.default_root_dir) holds one run: resume it with --ckpt_path, or pass "
    "--overwrite_run_dir true to write over it. `grpo plot RUN_DIR` draws a run's curves to a PNG "
    "(`grpo plot --help`)."
)
# The trainer of the run `main` is executing: errors after its first optimizer step keep their traceback.
_current_trainer: ContextVar[Any] = ContextVar("grpo_current_trainer", default=None)


def mlflow_logger_config(root_dir: str, experiment_name: str = "grpo") -> dict[str, Any]:
    """The default logger: MLflow with a sqlite store in the run folder (``mlflow ui`` reads it)."""
    root = os.path.abspath(root_dir)
    return {
        "class_path": MLFLOW_LOGGER,
        "init_args": {
            "experiment_name": experiment_name,
            # Not MLFLOW_TRACKING_URI: mlflow sets that variable itself once a run has started, so a
            # second run in the same process would write to the first run's store.
            "tracking_uri": f"sqlite:///{root}/mlflow.db",
            "artifact_location": os.path.join(root, "mlartifacts"),
        },
    }


class LogConfigToMLflow(SaveConfigCallback):
    """Writes the resolved config to ``<default_root_dir>/config.yaml`` and, for MLflow loggers,
    into the run itself (``config.yaml`` artifact plus one ``config/<key>`` param per setting).

    The file is written when training starts (``on_fit_start``: models built, strategy set up), so
    a run that fails before that leaves no ``config.yaml`` to make its folder look used; ``grpo
    validate`` leaves the training run's file alone."""

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        if trainer.is_global_zero:
            os.makedirs(trainer.default_root_dir, exist_ok=True)
            resumed = bool(self.config.get("ckpt_path"))  # keep the config that started the run
            path = os.path.join(trainer.default_root_dir, "config_resumed.yaml" if resumed else self.config_filename)
            self.parser.save(self.config, path, skip_unset=False, overwrite=True, multifile=False)

    def save_config(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from lightning.pytorch.loggers import MLFlowLogger

        for logger in trainer.loggers:
            if not isinstance(logger, MLFlowLogger):
                continue
            text = self.parser.dump(self.config, skip_unset=False)
            if stage == "fit" and trainer.is_global_zero:  # lets a resume continue this MLflow run
                write_run_record(trainer.default_root_dir, logger.run_id, getattr(logger, "_tracking_uri", ""),
                                 getattr(logger, "_experiment_name", ""))
            logged = logger.experiment.get_run(logger.run_id).data.params
            # A resumed run continues its MLflow run, whose params cannot change: the resume's own
            # config is kept as an artifact, and only settings new to the run become params.
            logger.experiment.log_text(logger.run_id, text, "config_resumed.yaml" if logged else "config.yaml")
            flat = _flatten(self.parser.dump(self.config, format="json", skip_unset=False))
            logger.log_hyperparams({f"config/{k}": v for k, v in flat.items() if f"config/{k}" not in logged})


def _flatten(config_json: str) -> dict[str, str]:
    import json

    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), item)
        else:
            out[prefix] = json.dumps(value)[:6000]

    walk("", json.loads(config_json))
    return out


class GRPOLightningCLI(LightningCLI):
    """LightningCLI with GRPO's defaults: MLflow logging and TRL's trainer defaults; loss and sampler
    names written out in full; checks of the run folder and run length before any model loads."""

    def __init__(self, *args: Any, objects: dict[str, Any] | None = None, **kwargs: Any) -> None:
        #: ``model.<arg>`` / ``data.<arg>`` -> the object the constructor gets (``run_cli(objects=...)``).
        self._objects = dict(objects or {})
        kwargs.setdefault("parser_class", GRPOArgumentParser)
        parser_kwargs = dict(kwargs.get("parser_kwargs") or {})
        parser_kwargs.setdefault("epilog", EPILOG)  # `grpo --help`; each subcommand's below
        for subcommand in self.subcommands():
            parser_kwargs[subcommand] = {"epilog": EPILOG, **parser_kwargs.get(subcommand, {})}
        kwargs["parser_kwargs"] = parser_kwargs
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument(
            "--overwrite_run_dir", type=bool, default=False,
            help="Let `grpo fit` write into a trainer.default_root_dir that holds another run (its files are "
                 "overwritten). Without it such a folder is refused unless resuming with --ckpt_path.",
        )
        parser.add_argument(
            "--checkpoint_every_n_steps", type=int, default=50,
            help="Default checkpointing (when no ModelCheckpoint is configured and trainer.enable_checkpointing is "
                 "on): a checkpoint every this many optimizer steps in <default_root_dir>/checkpoints, plus one when "
                 "training fails. Resume with --ckpt_path last.",
        )
        parser.add_argument(
            "--memory_plan", type=bool, default=True,
            help="Before the first step, estimate and print the peak memory per device (weights, gradients, optimizer "
                 "state, activations, logits, KV cache / vLLM share) and warn, naming the setting to change, when it "
                 "exceeds the device (grpo_lightning.callbacks.MemoryPlanner, docs/memory.md).",
        )
        parser.add_argument(
            "--keep_checkpoints", type=int, default=2,
            help="How many of the newest periodic checkpoints the default checkpointing keeps (last.ckpt links to "
                 "the newest).",
        )

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        config = self.config_init[self.subcommand] if self.subcommand else self.config_init
        if "logger" not in kwargs and config.trainer.logger in (None, True):
            # The default logger is made here, not written into the config: the saved config keeps
            # `logger: null`, so re-running it into another folder logs to that folder's store.
            from lightning.pytorch.loggers import MLFlowLogger

            root = config.trainer.default_root_dir or os.getcwd()
            settings = mlflow_logger_config(root)["init_args"]
            record = read_run_record(root) if self.subcommand == "fit" and config.get("ckpt_path") else None
            if record and record.get("tracking_uri") == settings["tracking_uri"]:
                settings["run_id"] = record["mlflow_run_id"]  # a resume continues its MLflow run
            if launched_as_rank_zero():
                kwargs["logger"] = MLFlowLogger(**settings)
            else:
                # Only rank 0 logs; an MLflow client on every process would also race to create
                # the sqlite store when a launcher (torchrun, SLURM) starts all ranks at once.
                from lightning.pytorch.loggers.logger import DummyLogger

                kwargs["logger"] = DummyLogger()
        trainer = super().instantiate_trainer(**kwargs)
        if "logger" not in kwargs and self.subcommand == "fit" and config.get("ckpt_path"):
            continue_recorded_run(trainer.loggers, read_run_record(config.trainer.default_root_dir or os.getcwd()))
        _current_trainer.set(trainer)
        return trainer

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Any]) -> Any:
        """The memory plan (unless ``--memory_plan false``) and checkpoints in the run folder
        (``cli.checkpoints``) unless checkpointing is off."""
        run = self.config[self.subcommand] if self.subcommand else self.config
        if self.subcommand == "fit" and run.get("memory_plan", True):
            from grpo_lightning.callbacks import MemoryPlanner

            configured = list(config.get("callbacks") or [])
            if not any(isinstance(c, MemoryPlanner) for c in configured):
                config["callbacks"] = [*configured, MemoryPlanner()]
        if self.subcommand == "fit" and config.get("enable_checkpointing") is not False:
            root = config.get("default_root_dir") or os.getcwd()
            configured = list(config.get("callbacks") or [])
            config["callbacks"] = place_checkpoints(configured, root, int(run.get("checkpoint_every_n_steps", 50)),
                                                    int(run.get("keep_checkpoints", 2)))
        return super()._instantiate_trainer(config, callbacks)

    def _add_instantiators(self) -> None:
        super()._add_instantiators()
        for section, cls in (("model", self._model_class), ("data", self._datamodule_class)):
            given = {k.split(".", 1)[1]: v for k, v in self._objects.items() if k.startswith(section + ".")}
            if given:  # objects the parser's types cannot check go straight to the constructor
                self.parser.add_instantiator(_WithObjects(given), cls, subclasses=True, prepend=True)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        expanded = expand_component_names(config)  # what runs is what config.yaml records
        for key in COMPONENTS:
            if key in config:
                config[key] = expanded[key]
        trainer = config.trainer
        check_trainer_settings(trainer)  # the run length too
        if self.subcommand:  # a run (fit, validate, ...), not a parse of the config (run=False)
            check_accelerator(trainer.accelerator)
        if self.subcommand == "fit":
            root = trainer.default_root_dir or os.getcwd()
            if launched_as_rank_zero():  # other ranks (other nodes) may start after rank 0 wrote the folder
                check_run_dir(root, config.get("ckpt_path"), bool(config.get("overwrite_run_dir")),
                              config.get("model.output_dir"))
            config["ckpt_path"] = resolve_ckpt_path(config.get("ckpt_path"), root)
            if config.get("overwrite_run_dir") and not config.get("ckpt_path") and launched_as_rank_zero():
                forget_previous_run(root)


class _WithObjects:
    """Instantiates a class with some ``__init__`` arguments replaced by Python objects (``run_cli(objects=...)``)."""

    def __init__(self, objects: dict[str, Any]) -> None:
        self.objects = objects

    def __call__(self, class_type: type, *args: Any, applied_instantiation_links: dict | None = None, **kwargs: Any) -> Any:
        return class_type(*args, **{**kwargs, **self.objects})


def launched_as_rank_zero() -> bool:
    """Whether this process is the job's first one, by the variables launchers set before Python
    starts (torchrun, SLURM, Lightning's own DDP launcher for the processes it starts)."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK"))


class _StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is at each record (a caller may swap it between runs), not to the
    stream that was current when the handler was made."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> Any:  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def _show_package_logs() -> None:
    package_log = logging.getLogger("grpo_lightning")
    if not package_log.handlers:
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        package_log.addHandler(handler)
        package_log.setLevel(logging.INFO)


def run_cli(args: list[str] | dict[str, Any] | None = None, *, callbacks: list[Any] | None = None,
            objects: dict[str, Any] | None = None) -> GRPOLightningCLI:
    """Run ``grpo`` with ``args`` (default: the command line) and return the CLI object.

    ``args`` may also be a config dict (``{"fit": {...}}``, what a YAML file holds, Python objects
    allowed where the types take them: ``grpo_lightning.GRPOTrainer`` runs this way).
    ``callbacks`` are added to the trainer's callbacks without being part of the config
    (observers: they are not written to ``config.yaml``). ``objects`` (``{"model.model": model}``)
    are ``__init__`` arguments of the module or datamodule given to the constructor in place of the
    config's value, for objects the parser's types cannot check."""
    _show_package_logs()
    # Lightning 2.6 against torch >= 2.10 warns on every run from its own code; nothing to act on.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    # bitsandbytes (imported through peft by transformers' optimizers) tries to fetch an optional
    # CPU 4-bit kernel from the hub on AVX512-BF16 CPUs and logs "Failed to load ..." on every run
    # without internet, quantized or not; it falls back to its own kernel.
    logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_drop_hub_kernel_notice)
    return GRPOLightningCLI(
        GRPOModule,
        RolloutDataModule,
        trainer_defaults={**TRAINER_DEFAULTS, "callbacks": list(callbacks)} if callbacks else TRAINER_DEFAULTS,
        save_config_callback=LogConfigToMLflow,
        save_config_kwargs={"overwrite": True, "save_to_log_dir": False},
        seed_everything_default=42,
        args=args,  # None: LightningCLI reads the command line
        auto_configure_optimizers=False,
        objects=objects,
    )


def _drop_hub_kernel_notice(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward from kernels-community")


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``grpo`` console script (returns nothing: the exit status is 0).

    A user error (``grpo_lightning.errors.is_user_error``) prints its message and exits with status
    1; ``GRPO_DEBUG=1`` lets every error through with its traceback, jsonargparse's included.
    """
    token = _current_trainer.set(None)
    if debug_enabled():
        os.environ.setdefault("JSONARGPARSE_DEBUG", "true")
    # As `python -m` does: configs may name the user's own code in the working directory
    # (`class_path: callbacks.StopWhenRewardReached`); the console script alone would not find it.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        argv = sys.argv[1:] if args is None else list(args)
        if argv[:1] == ["plot"]:  # not a LightningCLI subcommand
            from grpo_lightning.cli.plot import plot_main

            plot_main(argv[1:])
        else:
            run_cli(args)
    except Exception as error:
        trainer = _current_trainer.get()
        started = trainer is not None and trainer.global_step > 0
        reported = None if debug_enabled() else find_user_error(error, training_started=started)
        if reported is None:
            raise
        key = component_key(reported, {key: base for key, (base, _) in COMPONENTS.items()})
        sys.stderr.write(user_message(reported, with_setting(str(reported), key)) + "\n")
        sys.exit(1)
    finally:
        _current_trainer.reset(token)

