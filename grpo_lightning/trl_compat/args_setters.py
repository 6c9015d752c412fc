"""``TrainingArguments``' grouped setters (``args.set_training(...)``, ``set_logging``, ``set_save``,
...), for :class:`~grpo_lightning.trl_compat.GRPOConfig`: each sets its fields as transformers
does, with transformers' defaults, checks its strategies the same way and returns ``self``.

A strategy is stored as its string value (``"steps"``), as the other ``GRPOConfig`` fields hold it;
transformers' enums are accepted too. Layer L7 (trl_compat).
"""

from __future__ import annotations

import warnings
from typing import Any, TypeVar

Self = TypeVar("Self", bound="TrainingArgumentsSetters")


def _choice(enum_name: str, value: Any, module: str = "transformers.trainer_utils") -> str:
    """``value`` checked against transformers' enum ``enum_name`` (its ``ValueError`` on a bad one)."""
    import importlib

    enum = getattr(importlib.import_module(module), enum_name)
    return enum(value).value


def _set(args: Any, **values: Any) -> None:
    for name, value in values.items():
        setattr(args, name, value)


def _positive_steps(strategy: str, steps: float, setting: str) -> None:
    if strategy == "steps" and steps == 0:
        raise ValueError(f"{setting}: setting `strategy` as 'steps' requires a positive value for `steps`.")


class TrainingArgumentsSetters:
    """Mixin of ``GRPOConfig``: ``TrainingArguments.set_*``."""

    def set_training(self: Self, learning_rate: float = 5e-5, batch_size: int = 8, weight_decay: float = 0,
                     num_epochs: float = 3, max_steps: int = -1, gradient_accumulation_steps: int = 1, seed: int = 42,
                     activation_checkpointing: bool = False, gradient_checkpointing: bool | None = None) -> Self:
        """The training fields (``do_train`` on); ``gradient_checkpointing`` is transformers 5's deprecated name."""
        _set(self, do_train=True, learning_rate=learning_rate, per_device_train_batch_size=batch_size,
                      weight_decay=weight_decay, num_train_epochs=num_epochs, max_steps=max_steps,
                      gradient_accumulation_steps=gradient_accumulation_steps, seed=seed)
        if gradient_checkpointing is not None:
            warnings.warn("`gradient_checkpointing` is deprecated and will be removed in v6. Use "
                          "`activation_checkpointing` instead.", FutureWarning, stacklevel=2)
            activation_checkpointing = gradient_checkpointing
        self.gradient_checkpointing = activation_checkpointing
        return self

    def set_evaluate(self: Self, strategy: Any = "no", steps: int = 500, batch_size: int = 8,
                     accumulation_steps: int | None = None, delay: float | None = None, loss_only: bool = False) -> Self:
        """The evaluation fields (``do_eval`` follows the strategy)."""
        strategy = _choice("IntervalStrategy", strategy)
        _positive_steps(strategy, steps, "set_evaluate")
        _set(self, eval_strategy=strategy, do_eval=strategy != "no", eval_steps=steps,
                             per_device_eval_batch_size=batch_size, eval_accumulation_steps=accumulation_steps,
                             eval_delay=delay, prediction_loss_only=loss_only)
        return self

    def set_testing(self: Self, batch_size: int = 8, loss_only: bool = False) -> Self:
        """The prediction fields (``do_predict`` on)."""
        _set(self, do_predict=True, per_device_eval_batch_size=batch_size, prediction_loss_only=loss_only)
        return self

    def set_save(self: Self, strategy: Any = "steps", steps: int = 500, total_limit: int | None = None,
                 on_each_node: bool = False) -> Self:
        """The checkpoint fields."""
        strategy = _choice("SaveStrategy", strategy)
        _positive_steps(strategy, steps, "set_save")
        _set(self, save_strategy=strategy, save_steps=steps, save_total_limit=total_limit,
                             save_on_each_node=on_each_node)
        return self

    def set_logging(self: Self, strategy: Any = "steps", steps: int = 500, report_to: str | list[str] = "none",
                    level: str = "passive", first_step: bool = False, nan_inf_filter: bool = False,
                    on_each_node: bool = False, replica_level: str = "passive") -> Self:
        """The logging fields."""
        strategy = _choice("IntervalStrategy", strategy)
        _positive_steps(strategy, steps, "set_logging")
        _set(self, logging_strategy=strategy, logging_steps=steps, report_to=report_to, log_level=level,
                             logging_first_step=first_step, logging_nan_inf_filter=nan_inf_filter,
                             log_on_each_node=on_each_node, log_level_replica=replica_level)
        return self

    def set_push_to_hub(self: Self, model_id: str, strategy: Any = "every_save", token: str | None = None,
                        private_repo: bool | None = None, always_push: bool = False, revision: str | None = None) -> Self:
        """The Hub fields (``push_to_hub`` on)."""
        _set(self, push_to_hub=True, hub_model_id=model_id, hub_strategy=_choice("HubStrategy", strategy),
                             hub_token=token, hub_private_repo=private_repo, hub_always_push=always_push,
                             hub_revision=revision)
        return self

    def set_optimizer(self: Self, name: Any = "adamw_torch", learning_rate: float = 5e-5, weight_decay: float = 0,
                      beta1: float = 0.9, beta2: float = 0.999, epsilon: float = 1e-8, args: str | None = None) -> Self:
        """The optimizer fields."""
        _set(self, optim=_choice("OptimizerNames", name, "transformers.training_args"),
                             learning_rate=learning_rate, weight_decay=weight_decay, adam_beta1=beta1, adam_beta2=beta2,
                             adam_epsilon=epsilon, optim_args=args)
        return self

    def set_lr_scheduler(self: Self, name: Any = "linear", num_epochs: float = 3.0, max_steps: int = -1,
                         warmup_steps: float = 0) -> Self:
        """The learning-rate schedule fields."""
        _set(self, lr_scheduler_type=_choice("SchedulerType", name), num_train_epochs=num_epochs,
                             max_steps=max_steps, warmup_steps=warmup_steps)
        return self

    def set_dataloader(self: Self, train_batch_size: int = 8, eval_batch_size: int = 8, drop_last: bool = False,
                       num_workers: int = 0, pin_memory: bool = True, persistent_workers: bool = False,
                       prefetch_factor: int | None = None, multiprocessing_context: str | None = None,
                       in_order: bool = True, auto_find_batch_size: bool = False, ignore_data_skip: bool = False,
                       sampler_seed: int | None = None) -> Self:
        """The data-loading fields."""
        _set(self, 
            per_device_train_batch_size=train_batch_size, per_device_eval_batch_size=eval_batch_size,
            dataloader_drop_last=drop_last, dataloader_num_workers=num_workers, dataloader_pin_memory=pin_memory,
            dataloader_persistent_workers=persistent_workers, dataloader_prefetch_factor=prefetch_factor,
            dataloader_multiprocessing_context=multiprocessing_context, dataloader_in_order=in_order,
            auto_find_batch_size=auto_find_batch_size, ignore_data_skip=ignore_data_skip, data_seed=sampler_seed,
        )
        return self
