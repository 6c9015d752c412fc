"""``grpo``: the command line (LightningCLI over ``GRPOModule`` and ``RolloutDataModule``).

    grpo fit --config configs/quickstart.yaml
    grpo fit --config cfg.yaml --model.learning_rate 1e-5 --trainer.max_steps 100
    grpo fit --config cfg.yaml --print_config

With no logger configured, runs log to MLflow in a sqlite store under the run folder
(``<trainer.default_root_dir>/mlflow.db``); any Lightning logger can be configured instead.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule

# TRL's defaults where Lightning's differ: max_grad_norm=1.0, logging_steps=10, no sanity-check generation.
TRAINER_DEFAULTS: dict[str, Any] = {"gradient_clip_val": 1.0, "log_every_n_steps": 10, "num_sanity_val_steps": 0}
MLFLOW_LOGGER = "lightning.pytorch.loggers.MLFlowLogger"


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
    into the run itself (``config.yaml`` artifact plus one ``config/<key>`` param per setting)."""

    def save_config(self, trainer: Any, pl_module: Any, stage: str) -> None:
        from lightning.pytorch.loggers import MLFlowLogger

        if trainer.is_global_zero:
            os.makedirs(trainer.default_root_dir, exist_ok=True)
            path = os.path.join(trainer.default_root_dir, self.config_filename)
            self.parser.save(self.config, path, skip_unset=False, overwrite=True, multifile=False)
        for logger in trainer.loggers:
            if not isinstance(logger, MLFlowLogger):
                continue
            text = self.parser.dump(self.config, skip_unset=False)
            logger.experiment.log_text(logger.run_id, text, "config.yaml")
            flat = _flatten(self.parser.dump(self.config, format="json", skip_unset=False))
            logger.log_hyperparams({f"config/{k}": v for k, v in flat.items()})


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
    """LightningCLI with GRPO's defaults: MLflow logging and TRL's trainer defaults."""

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        trainer = config.trainer
        if trainer.logger in (None, True):
            root = trainer.default_root_dir or os.getcwd()
            from jsonargparse import Namespace

            logger = mlflow_logger_config(root)
            trainer.logger = Namespace(class_path=logger["class_path"], init_args=Namespace(**logger["init_args"]))


def _show_package_logs() -> None:
    package_log = logging.getLogger("grpo_lightning")
    if not package_log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
        package_log.addHandler(handler)
        package_log.setLevel(logging.INFO)


def run_cli(args: list[str] | None = None) -> GRPOLightningCLI:
    """Run ``grpo`` with ``args`` (default: the command line) and return the CLI object."""
    _show_package_logs()
    # Lightning 2.6 against torch >= 2.10 warns on every run from its own code; nothing to act on.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")
    return GRPOLightningCLI(
        GRPOModule,
        RolloutDataModule,
        trainer_defaults=TRAINER_DEFAULTS,
        save_config_callback=LogConfigToMLflow,
        save_config_kwargs={"overwrite": True, "save_to_log_dir": False},
        seed_everything_default=42,
        args=args,  # None: LightningCLI reads the command line
        auto_configure_optimizers=False,
    )


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``grpo`` console script (returns nothing: the exit status is 0)."""
    run_cli(args)


if __name__ == "__main__":
    main()
