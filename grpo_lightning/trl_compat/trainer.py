"""``GRPOTrainer``: TRL's trainer class on top of ``grpo fit``.

The trainer turns its arguments into the ``grpo fit`` config they amount to (``plan.build_config``)
and runs that config through the same CLI class ``grpo fit`` uses (``cli.run_cli``): same module,
datamodule, Lightning ``Trainer``, strategy, default callbacks, checkpoints and run-folder files.
``to_yaml()`` writes that config, so ``grpo fit --config`` replays the run.

Layer L7 (trl_compat): above ``cli``.
"""

from __future__ import annotations

import copy
import os
from typing import Any, NamedTuple

from grpo_lightning.errors import ConfigError
from grpo_lightning.trl_compat.builder import run_config, yaml_config
from grpo_lightning.trl_compat.callbacks import TrainerCallbacks
from grpo_lightning.trl_compat.config import GRPOConfig
from grpo_lightning.trl_compat.hub import model_card, upload
from grpo_lightning.trl_compat.plan import build_config


class TrainOutput(NamedTuple):
    """What ``train()`` returns (transformers' ``TrainOutput``)."""

    global_step: int
    training_loss: float
    metrics: dict[str, float]


class GRPOTrainer:
    """TRL's ``GRPOTrainer``, running on grpo-lightning: change ``from trl import GRPOTrainer`` to
    ``from grpo_lightning import GRPOTrainer`` (and ``GRPOConfig`` with it).

    The arguments are TRL's (docs/trl_compat.md lists what differs). Nothing is loaded here: the
    model is built when ``train()`` (or ``evaluate()``) runs; in-memory datasets and tokenizers are
    written to ``<output_dir>/trl_inputs/`` so the run can be replayed from its YAML file.

    Args:
        model: A model path or Hub id, or a ``PreTrainedModel`` / ``PeftModel`` object.
        reward_funcs: A reward function (sync or async), a reward model path or object, a built-in
            reward name, or a list of them.
        args: A :class:`GRPOConfig` (default: TRL's defaults, ``output_dir`` ``<model name>-GRPO``).
        train_dataset: A ``datasets.Dataset`` or ``IterableDataset`` with a ``prompt`` column.
        eval_dataset: A dataset, or ``{name: dataset}`` for named evaluation sets.
        processing_class: The policy's tokenizer (default: the model's).
        reward_processing_classes: Tokenizers of the reward models (one, or one per reward function).
        callbacks: Hugging Face ``TrainerCallback``s (classes or instances) and Lightning callbacks.
        optimizers: ``(optimizer, None)``: an optimizer built on the model object's parameters.
        quantization_config: A ``BitsAndBytesConfig`` (QLoRA, with ``peft_config``).
        peft_config: A ``peft.LoraConfig``.
        tools: Tool functions the model may call.
        rollout_func: Your generation function (``RolloutFuncSampler``; its signature: docs/samplers.md).
        environment_factory: An environment class (or factory), or ``{name: factory}``.
    """

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list[Any] | None = None,
        rollout_func: Any = None,
        environment_factory: Any = None,
    ) -> None:
        self._setup(model, reward_funcs, args, train_dataset, eval_dataset, processing_class, reward_processing_classes,
                    callbacks, optimizers, quantization_config, peft_config, tools, rollout_func, environment_factory)

    def _setup(self, model: Any, reward_funcs: Any, args: GRPOConfig | None, train_dataset: Any, eval_dataset: Any,
               processing_class: Any, reward_processing_classes: Any, callbacks: list[Any] | None,
               optimizers: tuple[Any, Any], quantization_config: Any, peft_config: Any, tools: list[Any] | None,
               rollout_func: Any, environment_factory: Any, require_data: bool = True) -> None:
        if model is None:
            raise ConfigError("GRPOTrainer needs model: a path or Hub id, or a model object.")
        if args is None:
            args = GRPOConfig(output_dir=f"{_model_name(model)}-GRPO")
        if not isinstance(args, GRPOConfig):
            raise ConfigError(f"args is a {type(args).__module__}.{type(args).__name__}: pass a "
                              "grpo_lightning.GRPOConfig (from grpo_lightning import GRPOConfig).")
        self.args = args
        self.model_source, self.reward_funcs = model, reward_funcs
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self._processing_class = processing_class
        hf_callbacks, self._lightning_callbacks = _split_callbacks(callbacks or [])
        self.callback_handler = TrainerCallbacks(hf_callbacks, args=args)  # refuses unsupported events now
        self._plan = build_config(
            args, model=model, reward_funcs=reward_funcs, train_dataset=train_dataset, eval_dataset=eval_dataset,
            processing_class=processing_class, reward_processing_classes=reward_processing_classes,
            optimizers=optimizers, quantization_config=quantization_config, peft_config=peft_config, tools=tools,
            rollout_func=rollout_func, environment_factory=environment_factory, require_data=require_data)
        self._cli: Any = None

    # ------------------------------------------------------------------ the config
    @property
    def config(self) -> dict[str, Any]:
        """The ``grpo fit`` config this trainer runs (the ``fit`` section; objects where given)."""
        return copy.copy(self._plan.config)

    def to_yaml(self, path: str | os.PathLike[str] | None = None) -> str:
        """The run as a ``grpo fit`` YAML file (written to ``path`` when given): ``grpo fit --config
        <file>`` replays it. Raises ``ReplayError`` naming each value that exists only in memory."""
        import yaml

        config = yaml_config(self._plan.config)
        hf_callbacks = self.callback_handler.sources()  # as they are now (add_callback, pop_callback, ...)
        if hf_callbacks:  # the HF callbacks run in memory (callback_handler); in YAML:
            trainer = config.setdefault("trainer", {})
            spec = _callbacks_spec(hf_callbacks, self.args)
            trainer["callbacks"] = [*(trainer.get("callbacks") or []), *yaml_config([spec])]
        text = yaml.safe_dump(config, sort_keys=False)
        if path is not None:
            with open(path, "w") as f:
                f.write(text)
        return text

    def _run(self, subcommand: str, config: dict[str, Any], objects: dict[str, Any]) -> Any:
        from grpo_lightning.cli import run_cli

        self._cli = run_cli({subcommand: config}, callbacks=[self.callback_handler, *self._lightning_callbacks],
                            objects=objects)
        return self._cli

    # ------------------------------------------------------------------ TRL's methods
    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> TrainOutput:
        """Train (``grpo fit``). ``resume_from_checkpoint``: ``True`` resumes from the newest checkpoint
        of ``output_dir``, a path from that checkpoint (``--ckpt_path``)."""
        if trial is not None:
            raise ConfigError("train(trial=...): hyperparameter search is not supported.")
        if kwargs:
            raise TypeError(f"train() got unexpected keyword arguments {sorted(kwargs)}.")
        config, objects = run_config(self._plan.config)
        if resume_from_checkpoint:
            config["ckpt_path"] = "last" if resume_from_checkpoint is True else str(resume_from_checkpoint)
            config["overwrite_run_dir"] = False  # resuming continues the run in the folder
        losses_before = len(self.callback_handler.step_losses)
        cli = self._run("fit", config, objects)
        losses = self.callback_handler.step_losses[losses_before:]
        # HF returns the dict it logged at the end (Trainer.log added epoch to it): the summary, less step.
        metrics = {k: v for k, v in self.callback_handler.train_summary.items() if k != "step"}
        return TrainOutput(cli.trainer.global_step, sum(losses) / len(losses) if losses else float("nan"), metrics)

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval") -> dict[str, float]:
        """Generate and score the evaluation set(s) with the current policy; the ``eval_*`` metrics."""
        if eval_dataset is not None:
            raise ConfigError("evaluate(eval_dataset=...) is not supported: pass eval_dataset to GRPOTrainer.")
        if metric_key_prefix != "eval":
            raise ConfigError(f"evaluate(metric_key_prefix={metric_key_prefix!r}): metrics are always named eval_*.")
        if self.eval_dataset is None:
            raise ConfigError("evaluate() needs an eval_dataset: pass eval_dataset to GRPOTrainer.")
        handler = self.callback_handler
        if self._cli is not None:
            trainer = self._cli.trainer
            limit, trainer.limit_val_batches = trainer.limit_val_batches, 1.0
            try:
                trainer.validate(self._cli.model, datamodule=self._cli.datamodule, verbose=False)
            finally:
                trainer.limit_val_batches = limit
        else:
            config, objects = run_config(self._plan.config)
            config["trainer"].pop("limit_val_batches", None)
            self._run("validate", config, objects)
        return {**handler._eval_logs, "epoch": handler.epoch}

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the policy and its tokenizer with ``save_pretrained`` (default: ``args.output_dir``)."""
        folder = output_dir or self.args.output_dir
        if self._cli is not None:
            self._cli.model.export(folder)
        elif not isinstance(self.model_source, str):
            self.model_source.save_pretrained(folder)
            if self._processing_class is not None:
                self._processing_class.save_pretrained(folder)
        else:
            raise ConfigError("save_model() before train() or evaluate(): the model is built when they run (the "
                              f"untrained model is {self.model_source!r}).")
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save")

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True,
                    token: str | None = None, revision: str | None = None, private: bool | None = None,
                    **kwargs: Any) -> Any:
        """Save the model to ``<output_dir>/final_model`` with a model card and upload that folder to
        ``args.hub_model_id`` (default: the output folder's name) with ``huggingface_hub``; a new
        repository is private when ``private`` is ``True`` (``None``: ``args.hub_private_repo``)."""
        folder = os.path.join(self.args.output_dir, "final_model")
        self.save_model(folder, _internal_call=True)  # every rank: the export is collective
        if not self.is_world_process_zero():
            return None
        model_card(folder, self, **kwargs)
        self.callback_handler.push_begin()
        return upload(folder, self.args, commit_message=commit_message, blocking=blocking, token=token,
                      revision=revision, private=private)

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None) -> None:
        """Write the model card (``README.md``) to ``args.output_dir``, on the main process only (as TRL)."""
        if self.is_world_process_zero():
            model_card(self.args.output_dir, self, model_name=model_name, dataset_name=dataset_name, tags=tags)

    # ------------------------------------------------------------------ callbacks and logs (transformers' API)
    def add_callback(self, callback: Any) -> None:
        """Add a callback for the next run: an HF ``TrainerCallback`` or a Lightning ``Callback`` (a class is
        built without arguments), as the constructor's ``callbacks`` take them."""
        hf, lightning = _split_callbacks([callback])
        self._lightning_callbacks.extend(lightning)
        for each in hf:
            self.callback_handler.add_callback(each)

    def pop_callback(self, callback: Any) -> Any:
        """Remove and return the first callback of class ``callback`` (or that instance), HF callbacks
        first, then Lightning ones; ``None`` when there is none."""
        popped = self.callback_handler.pop_callback(callback)
        if popped is not None:
            return popped
        for existing in self._lightning_callbacks:
            if isinstance(existing, callback) if isinstance(callback, type) else existing is callback:
                self._lightning_callbacks.remove(existing)
                return existing
        return None

    def remove_callback(self, callback: Any) -> None:
        """Remove the first callback of class ``callback``, or that instance (HF or Lightning; an instance
        that is in neither list raises ``ValueError``, as in transformers)."""
        if self.pop_callback(callback) is None and not isinstance(callback, type):
            raise ValueError(f"{callback!r} is not among the trainer's callbacks.")

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Record ``logs`` in ``log_history`` (with ``epoch`` and ``step``) and call ``on_log`` with them;
        during a run (from a callback) they also go to its loggers (``report_to``), as in transformers."""
        self.callback_handler.log_logs(logs)

    def is_world_process_zero(self) -> bool:
        """Whether this is the global main process (the Lightning trainer's rank once it runs; before,
        ``args.process_index``: ``RANK`` from the launcher)."""
        if self._cli is not None:
            return bool(self._cli.trainer.is_global_zero)
        return self.args.process_index == 0

    def is_local_process_zero(self) -> bool:
        """Whether this is the main process of its node."""
        if self._cli is not None:
            return self._cli.trainer.local_rank == 0
        return self.args.local_process_index == 0

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> Any:
        """The ``transformers.TrainerState`` the callbacks see (``global_step``, ``epoch``, ``max_steps``,
        ``log_history``, ...), kept current during a run."""
        return self.callback_handler.state

    @property
    def log_history(self) -> list[dict[str, Any]]:
        """One dict per log (the step's metrics, ``epoch``, ``step``), as ``trainer.state.log_history``."""
        return self.callback_handler.log_history

    @property
    def model(self) -> Any:
        """The policy being trained (after ``train()`` / ``evaluate()``; before, the model object given)."""
        if self._cli is not None:
            return self._cli.model.policy
        if not isinstance(self.model_source, str):
            return self.model_source
        raise AttributeError(f"GRPOTrainer.model is built when train() or evaluate() runs (from {self.model_source!r}).")

    @property
    def processing_class(self) -> Any:
        if self._cli is not None:
            return self._cli.model.tokenizer
        return self._processing_class

    @property
    def lightning_trainer(self) -> Any:
        """The Lightning ``Trainer`` of the last run (``None`` before one)."""
        return None if self._cli is None else self._cli.trainer


def _model_name(model: Any) -> str:
    name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "") or "model"
    return str(name).rstrip("/").split("/")[-1]


def _split_callbacks(callbacks: list[Any]) -> tuple[list[Any], list[Any]]:
    """(Hugging Face callbacks, Lightning callbacks)."""
    import lightning.pytorch as pl

    hf, lightning = [], []
    for callback in callbacks:
        is_lightning = isinstance(callback, pl.Callback) or isinstance(callback, type) and issubclass(callback, pl.Callback)
        if is_lightning:
            lightning.append(callback() if isinstance(callback, type) else callback)
        else:
            hf.append(callback)
    return hf, lightning


def _callbacks_spec(hf_callbacks: list[Any], args: GRPOConfig) -> Any:
    """The YAML entry of the HF callbacks (classes by dotted path; instances exist only in memory)."""
    from grpo_lightning.trl_compat.builder import InMemory
    from grpo_lightning.trl_compat.replay import dotted_path

    paths, reasons = [], []
    for callback in hf_callbacks:
        path, reason = dotted_path(callback) if isinstance(callback, type) else (None, (
            f"callback {type(callback).__name__} is an instance: pass its class (built without arguments)"))
        paths.append(path)
        if reason:
            reasons.append(reason)
    spec = {"class_path": "grpo_lightning.trl_compat.callbacks.TrainerCallbacks",
            "init_args": {"callbacks": paths, "args": _changed_fields(args)}}
    return InMemory(None, None if reasons else spec, "; ".join(reasons))


def _changed_fields(args: GRPOConfig) -> dict[str, Any]:
    """The fields that differ from TRL's defaults, as YAML values (derived sizes left to be derived again)."""
    default = GRPOConfig()
    out = {}
    for name, value in args.to_dict().items():
        derived = name == "generation_batch_size" or name == "steps_per_generation" and (
            value == args.gradient_accumulation_steps)
        if derived or name.endswith("_token") or value == getattr(default, name):
            continue
        out[name] = getattr(value, "value", value)
    return out


def config_to_yaml(args: GRPOConfig | None = None, path: str | os.PathLike[str] | None = None,
                   **trainer_arguments: Any) -> str:
    """The ``grpo fit`` YAML file of ``GRPOTrainer(args=args, **trainer_arguments)`` (written to
    ``path`` when given), without building or training anything.

    ``trainer_arguments`` are ``GRPOTrainer``'s (``model``, ``reward_funcs``, ``train_dataset``, ...);
    the ones left out are left out of the file too (``model.model``, ``data.dataset``: to be filled in).
    """
    import inspect

    names = list(inspect.signature(GRPOTrainer.__init__).parameters)[1:]
    unknown = sorted(set(trainer_arguments) - set(names))
    if unknown:
        raise TypeError(f"config_to_yaml() got unexpected arguments {unknown}; GRPOTrainer takes {names}.")
    values = {name: trainer_arguments.get(name) for name in names}
    values["args"] = args if args is not None else GRPOConfig()
    values["optimizers"] = values["optimizers"] or (None, None)
    no_model = values["model"] is None
    if no_model:
        values["model"] = "<model>"
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    trainer._setup(*values.values(), require_data=False)
    if no_model:
        trainer._plan.config["model"].pop("model")
    return trainer.to_yaml(path)
