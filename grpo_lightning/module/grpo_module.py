"""``GRPOModule``: the policy, the optional reference model, the loss and the optimizer."""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from typing import Any, ContextManager, Literal

import lightning.pytorch as pl
import torch
from jsonargparse import lazy_instance
from lightning.pytorch.cli import OptimizerCallable

from grpo_lightning.losses import LossOutput, MicroBatchTotals, PolicyLoss, get_loss
from grpo_lightning.losses.clipped import DAPOLoss
from grpo_lightning.module.callback_metrics import publish_step_metrics
from grpo_lightning.module.deepspeed_steps import check_strategy_setup, deepspeed_grad_norm, deepspeed_step_applied
from grpo_lightning.module.entropy_selection import EntropyWindow, check_top_entropy_quantile, entropy_coef_metrics, world_sum
from grpo_lightning.module.fit_end_release import TrainingStateRelease
from grpo_lightning.module.forward import ForwardOptions, completion_logprobs
from grpo_lightning.module.gradients import clip_gradients_, step_grad_norm
from grpo_lightning.module.metrics import MetricsWindow, TrainingMetrics, reduce_metric_values, world_row_mean
from grpo_lightning.module.model_building import ModelSettings, build_models, data_parallel_mesh
from grpo_lightning.module.model_checks import check_architecture_settings
from grpo_lightning.module.model_info import read_model_info
from grpo_lightning.module.model_loading import CausalLM, check_model_sources, load_tokenizer, tokenizer_source
from grpo_lightning.module.optimizer_settings import build_optimizer, check_optimizer_settings
from grpo_lightning.module.peft_models import drop_quantization_state, export_policy, reference_scope
from grpo_lightning.module.peft_settings import LoRASettings, QuantizationSettings, check_adapter_settings
from grpo_lightning.module.sharding import full_state_dict, generation_weights, plain_forward_reason
from grpo_lightning.module.restart_points import RestartPoints
from grpo_lightning.module.resumed_checkpoints import ResumedCheckpoints
from grpo_lightning.module.step_gradients import StepGradients
from grpo_lightning.module.step_logging import FlushStepLogs, log_evaluation
from grpo_lightning.module.training_forward import LossTerms, add_router_aux_loss, loss_inputs, rows_logprobs
from grpo_lightning.module.training_forward import score_batch
from grpo_lightning.module.training_parts import PartsBackward, StepLoss, training_parts
from grpo_lightning.types import RolloutBatch
from grpo_lightning.utils.lazy_defaults import fresh_instance


class GRPOModule(pl.LightningModule):
    """Trains a causal LM with Group Relative Policy Optimization.

    The module owns the policy (and, when the loss has a KL term, a frozen reference: a copy, or
    with ``peft_config`` the policy with its adapters disabled), turns
    each :class:`~grpo_lightning.types.RolloutBatch` into per-token log-probs of the completion
    tokens and hands them to the loss. Generation, rewards and advantages live on the data side.

    Args:
        model: A local path or hub id of a causal LM, or an instantiated ``PreTrainedModel``.
        tokenizer: Path/id of the tokenizer; defaults to ``model``'s. Without a pad token, EOS is
            used as pad.
        loss: The policy loss: a name (``grpo, dr_grpo, dapo, bnpo, cispo, sapo, luspo, vespo``) or
            a ``class_path`` with its knobs (``epsilon``, ``epsilon_high``, ``delta``, ``beta``,
            ``importance_sampling_level``, ...). A loss with ``beta != 0`` adds a reference model.
        learning_rate: Peak learning rate of the default AdamW optimizer (TRL default 1e-6).
        optimizer: An optimizer factory (``class_path`` + ``init_args``) replacing the default
            AdamW; receives the trainable parameters. Its ``lr`` and ``weight_decay`` go in its
            ``init_args``: setting ``learning_rate``/``weight_decay`` as well is an error.
        weight_decay: AdamW weight decay of the default optimizer.
        lr_scheduler_type: ``linear`` (TRL/HF default: decay to 0 over the run), ``cosine``,
            ``constant`` or ``constant_with_warmup``.
        warmup_steps: Linear warm-up optimizer steps (overrides ``warmup_ratio`` when > 0).
        warmup_ratio: Fraction of the planned optimizer steps used for warm-up.
        model_init_kwargs: Extra ``from_pretrained`` keyword arguments for a path/id ``model``.
        trust_remote_code: Allow custom model/tokenizer code from the model repository.
        dtype: Weight dtype for a path/id ``model`` (float32 by default: fp32 master weights,
            mixed precision comes from ``trainer.precision``).
        gradient_checkpointing: Recompute activations in backward to save memory (TRL default on).
        disable_dropout: Set every ``nn.Dropout`` probability to 0 in policy and reference.
        entropy_coef: Coefficient of the entropy bonus subtracted from the loss (0 disables);
            a public attribute that callbacks (``AdaptiveEntropy``: its start value) may adapt.
        top_entropy_quantile: Train the policy term on the top ``ρ`` fraction of active tokens by
            entropy only (0.2 in the paper; 0: the max-entropy token(s); 1: all), over all ranks.
        cast_lm_head_to_fp32: LM head weight and matmul in float32 (policy and reference), the
            rest per ``trainer.precision``; needs untied embeddings and no adapter on ``lm_head``.
        router_aux_loss_coef: Weight of a MoE model's router load-balancing loss (metric
            ``aux_loss``); ``null``: the model config's value; 0: off; an error on a dense model.
        output_dir: Where the final policy is exported; defaults to ``trainer.default_root_dir``.
        save_final_model: Export the policy and tokenizer with ``save_pretrained`` to
            ``<output_dir>/final_model`` when training ends (with ``peft_config``: the merged
            model there and the adapter alone in ``final_model/adapter``).
        keep_optimizer_state_after_fit: Keep the optimizer state when training ends; by default it
            is released (with the last gradients) before Lightning's teardown copies it to the host,
            and a checkpoint written after ``fit`` returns is refused (docs/resume.md).
        forward: How completion log-probs are computed (training, old and reference passes):
            ``chunked_lm_head`` (LM head on real completion tokens in chunks, no full-vocabulary
            fp32 logits), ``padding_free`` (packed sequences, no compute on padding),
            ``lm_head_chunk_tokens``, ``packed_row_tokens``, ``logprob_token_budget`` (no-grad
            passes in token-sized groups), ``train_token_budget`` (each training micro-batch in
            token-sized parts, one forward+backward each). Same values and gradients as the plain
            path, ``ForwardOptions.plain()``; see :class:`~grpo_lightning.module.forward.ForwardOptions`.
        peft_config: Train a LoRA adapter instead of the whole policy (``[peft]`` extra), e.g.
            ``{r: 16, lora_alpha: 32, target_modules: [q_proj, v_proj]}``; the reference is then the
            policy with its adapters disabled (no second copy). See ``docs/peft.md``.
        quantization_config: Load the base weights in 4-bit or 8-bit with bitsandbytes (QLoRA,
            ``[quantization]`` extra), e.g. ``{load_in_4bit: true}``; needs ``peft_config``.
    """

    def __init__(
        self,
        model: str | CausalLM,
        tokenizer: str | None = None,
        loss: PolicyLoss | str = lazy_instance(DAPOLoss),
        learning_rate: float = 1e-6,
        optimizer: OptimizerCallable | None = None,
        weight_decay: float = 0.0,
        lr_scheduler_type: Literal["linear", "cosine", "constant", "constant_with_warmup"] = "linear",
        warmup_steps: int = 0,
        warmup_ratio: float = 0.0,
        model_init_kwargs: dict[str, Any] | None = None,
        trust_remote_code: bool = False,
        dtype: Literal["float32", "bfloat16", "float16", "auto"] = "float32",
        gradient_checkpointing: bool = True,
        disable_dropout: bool = False,
        entropy_coef: float = 0.0,
        top_entropy_quantile: float = 1.0,
        cast_lm_head_to_fp32: bool = False,
        router_aux_loss_coef: float | None = None,
        output_dir: str | None = None,
        save_final_model: bool = True,
        keep_optimizer_state_after_fit: bool = False,
        forward: ForwardOptions = ForwardOptions(),
        peft_config: LoRASettings | None = None,
        quantization_config: QuantizationSettings | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model", "loss", "optimizer"] if not isinstance(model, str) else ["loss", "optimizer"])
        check_optimizer_settings(optimizer, learning_rate, weight_decay, warmup_ratio, warmup_steps)
        check_model_sources(model, tokenizer)  # before any weights or tokenizer load
        peft_config, quantization_config = check_adapter_settings(
            model, peft_config, quantization_config, model_init_kwargs=model_init_kwargs, trust_remote_code=trust_remote_code
        )
        self.loss: PolicyLoss = get_loss(fresh_instance(loss))
        router_coef = check_architecture_settings(  # from the model config, before the weights load
            model, cast_lm_head_to_fp32=cast_lm_head_to_fp32, router_aux_loss_coef=router_aux_loss_coef,
            peft_config=peft_config, trust_remote_code=trust_remote_code)
        self.loss_terms = LossTerms(check_top_entropy_quantile(top_entropy_quantile, forward), router_coef)
        self._tokenizer = load_tokenizer(tokenizer_source(model, tokenizer), trust_remote_code=trust_remote_code)
        self.model_info = read_model_info(model, trust_remote_code=trust_remote_code)
        # The weights are built in configure_model (where a strategy can shard them). A model
        # object is held in a tuple until then, so it is not registered as a submodule twice.
        self._model_source: tuple[Any] = (model,)
        self.model_settings = ModelSettings(model_init_kwargs, trust_remote_code, dtype, gradient_checkpointing,
                                            disable_dropout, peft_config, quantization_config, cast_lm_head_to_fp32)
        #: The frozen reference model (a submodule once built); ``None`` when ``beta == 0`` and with
        #: ``peft_config`` (the policy with adapters disabled): :meth:`reference_context` yields either.
        self.ref_policy: torch.nn.Module | None = None
        self._load_base: Any = None  # PEFT: a fresh base model for the merged export

        self.learning_rate = learning_rate
        self.optimizer_factory = optimizer
        self.weight_decay = weight_decay
        self.lr_scheduler_type = lr_scheduler_type
        self.warmup_steps = warmup_steps
        self.warmup_ratio = warmup_ratio
        self.entropy_coef = entropy_coef
        #: Set by an entropy controller (``AdaptiveEntropy``): each optimizer step's loss-token entropies,
        #: and the value logged as ``entropy_coef`` (its coefficient; the applied one may be gated to 0).
        self.entropy_window: EntropyWindow | None = None
        self.entropy_coef_metric: float | None = None
        self.output_dir = output_dir
        self.save_final_model = save_final_model
        self._fit_end = TrainingStateRelease(keep_optimizer_state_after_fit)
        self.forward_options = forward

        #: The metrics of the last finished optimizer step, by their TRL names (also in
        #: ``trainer.callback_metrics``): what callbacks such as ``EarlyStopping`` monitor.
        self.step_metrics: dict[str, float] = {}
        self._metrics = TrainingMetrics()
        self._eval_windows: dict[str, MetricsWindow] = {}  # metric prefix -> window
        self._parts = PartsBackward()
        self._grad_norm, self._step_seconds = math.nan, math.nan  # the closing step's, for its metrics
        self._step_gradients = StepGradients()  # dropped when their step ends, not in the next one
        self._exported_at_step: int | None = None  # on_train_end's export, for on_fit_end

    # ------------------------------------------------------------------------- models
    def configure_model(self) -> None:
        """Build the policy and, when the loss has ``beta != 0``, the frozen reference.

        Lightning calls this inside the strategy's init contexts (device, sharding, precision),
        so FSDP2/FSDP/DeepSpeed can shard what it builds; it is idempotent (fit, then validate).
        """
        if "policy" in self._modules:
            return
        mesh = data_parallel_mesh(getattr(self, "_device_mesh", None))
        built = build_models(self._model_source[0], self.model_settings, with_reference=self.loss.beta != 0, mesh=mesh)
        if sharded := plain_forward_reason(self._trainer and self.trainer.strategy):  # FSDP2, ZeRO-3: None
            self.forward_options = self.forward_options.under_sharding(sharded)
        self._modules["policy"] = built.policy  # add_module() would probe the ``policy`` property
        self.ref_policy, self._load_base = built.reference, built.load_base
        self._model_source = (None,)  # the policy now holds it

    @property
    def policy(self) -> torch.nn.Module:
        """The policy being trained (built by :meth:`configure_model`)."""
        policy = self._modules.get("policy")
        if policy is None:
            raise RuntimeError(
                "GRPOModule.policy is built in configure_model(): run it through a Trainer, or call "
                "module.configure_model() first."
            )
        return policy

    def setup(self, stage: str) -> None:
        self.forward_options.check_strategy(type(self.trainer.strategy).__name__)
        check_strategy_setup(self.trainer, adapters=self.model_settings.peft_config is not None)

    # ----------------------------------------------------------------- PolicyHandle protocol
    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    @property
    def policy_version(self) -> int:
        return self.trainer.global_step if self._trainer is not None else 0

    @property
    def needs_reference_logprobs(self) -> bool:
        return self.loss.beta != 0

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.model_info.eos_token_ids(self._tokenizer)

    @property
    def max_context_length(self) -> int | None:
        """The policy's context length (``max_position_embeddings``), when its config says."""
        return self.model_info.max_context_length

    def precision_context(self) -> ContextManager[None]:
        """The trainer's forward precision context (autocast under ``*-mixed`` precision)."""
        if self._trainer is None:
            return nullcontext()
        return self.trainer.precision_plugin.forward_context()

    def generation_context(self) -> ContextManager[None]:
        """Whole policy weights inside the block (FSDP2 unshard, ZeRO-3 gather); else a no-op."""
        return generation_weights(self.policy, self._trainer and self.trainer.strategy)

    def reference_context(self) -> ContextManager[torch.nn.Module]:
        """Yields the reference model for the block: ``ref_policy``, or under ``peft_config`` the
        policy with its adapters disabled (the base weights); raises when ``beta == 0``."""
        return reference_scope(self.policy, self.ref_policy, adapters_disabled=self.needs_reference_logprobs)

    @torch.no_grad()
    def rollout_logprobs(self, batch: RolloutBatch, *, reference: bool, chunk_size: int) -> torch.Tensor:
        """No-grad completion log-probs under the current policy or the reference, ``(B, T)``."""
        with self.reference_context() if reference else nullcontext(self.policy) as model:
            return rows_logprobs(model, batch, chunk_size, self.forward_options, self.precision_context,
                                 completion_logprobs)

    # ----------------------------------------------------------------------- training
    def training_step(self, batch: RolloutBatch, batch_idx: int) -> torch.Tensor:
        """Log-probs of the completion tokens → the policy loss → the step's metrics."""
        step = self._step_loss(batch, batch_idx)
        self._metrics.add(batch.generation_metrics)
        self._metrics.add_micro_step(step.metrics, self._all_reduce if self.trainer.world_size > 1 else None)
        self._metrics.loss = self._metrics.loss + step.value.float()  # read when the step closes (as HF Trainer's tr_loss)
        self._metrics.seconds += batch.prepare_seconds
        # The loss is in TRL's scale, which already divides by the step's accumulation count;
        # Lightning divides by accumulate_grad_batches again, so undo that here.
        return step.loss * self.trainer.accumulate_grad_batches

    def _step_loss(self, batch: RolloutBatch, batch_idx: int) -> StepLoss:
        parts = training_parts(batch, self.forward_options)  # [batch] unless a token budget splits it
        if len(parts) == 1:
            return StepLoss.of(self._policy_loss(batch, None))
        return self._parts.run(parts, self._policy_loss, MicroBatchTotals.of(batch.loss_mask), self.trainer, batch_idx)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        if not self._parts.skips_zero_grad(batch_idx):
            optimizer.zero_grad()

    def _policy_loss(self, batch: RolloutBatch, totals: MicroBatchTotals | None) -> LossOutput:
        """The loss of ``batch`` (a micro-batch, or the part of one whose ``totals`` are given)."""
        scored = score_batch(self.policy, batch, self.forward_options, self.loss_terms,  # (B, T) logps, entropies
                             entropy_requires_grad=self.entropy_coef != 0, all_reduce=world_sum(self.trainer.world_size))
        if self.entropy_window is not None and self.trainer.training and scored.entropies is not None:
            self.entropy_window.add(scored.entropies, batch.loss_mask, scored.entropy_mask)
        accumulation = batch.accumulation_steps or self.trainer.accumulate_grad_batches
        out = self.loss(loss_inputs(batch, scored, self.trainer.world_size, accumulation, self.entropy_coef, totals))
        share = 1.0 if totals is None else len(batch) / totals.rows
        return add_router_aux_loss(out, scored.aux_loss, self.loss_terms.router_aux_loss_coef, accumulation, share)

    # --------------------------------------------------------------------- evaluation
    def validation_step(self, batch: RolloutBatch, batch_idx: int, dataloader_idx: int = 0) -> None:
        """Score a freshly generated evaluation batch: TRL's ``eval_*`` metrics and ``eval_loss``
        (the loss in evaluation form: on-policy, a window of one micro-step)."""
        out = self._policy_loss(batch, None)
        window = self._eval_windows.setdefault(batch.metric_prefix, MetricsWindow())
        reduce = self._all_reduce if self.trainer.world_size > 1 else None
        window.add(batch.generation_metrics)
        window.add(reduce_metric_values(out.metrics, reduce))
        loss, rows = world_row_mean(out.loss, batch.counted_rows, reduce)
        window.add({"loss": loss}, weight=rows)  # HF's eval_loss: a mean over rows, not over steps

    def on_validation_epoch_end(self) -> None:
        windows, self._eval_windows = self._eval_windows, {}
        if not self.trainer.sanity_checking:
            log_evaluation(self, windows)

    def configure_callbacks(self) -> list[pl.Callback]:
        # metrics logged before checkpoints; no re-save of a resumed step; restart points (their docstrings)
        return [FlushStepLogs(self._metrics), ResumedCheckpoints(), RestartPoints()]

    # --------------------------------------------------- the end of an optimizer step
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's gradients are complete: measure their global norm (before clipping; the
        clipping uses it) and end the step's time (TRL's ``step_time`` stops before the optimizer)."""
        self._step_seconds = self._metrics.step_seconds()
        if self.trainer.strategy.handles_gradient_accumulation:
            return  # DeepSpeed: called on every micro-step, and the engine measures the norm (optimizer_step)
        self._grad_norm = step_grad_norm(self.trainer, self.policy.parameters(), optimizer)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Step, then publish the step's metrics: read once the update is queued, so a GPU runs it meanwhile."""
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        if deepspeed_step_applied(self.trainer):  # the micro-step that ended DeepSpeed's window
            self._grad_norm = deepspeed_grad_norm(self.trainer)
        elif self.trainer.strategy.handles_gradient_accumulation:
            return  # a DeepSpeed micro-step inside its window
        else:  # not DeepSpeed, whose engine zeroes its own gradients
            self._step_gradients.step_applied()
        self._publish_step_metrics(optimizer)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._step_gradients.release(self.trainer.optimizers)  # after every callback's (step_gradients.py)

    def _publish_step_metrics(self, optimizer: torch.optim.Optimizer) -> None:
        loss = self._world_mean(torch.as_tensor(self._metrics.loss, dtype=torch.float32, device=self.device))
        once = {"loss": float(loss), "step_time": self._step_seconds, "grad_norm": self._grad_norm,
                "learning_rate": optimizer.param_groups[0]["lr"]}
        once.update(entropy_coef_metrics(self.entropy_coef, self.entropy_coef_metric))
        self.step_metrics = self._metrics.close_step(once)
        publish_step_metrics(self.trainer, self.step_metrics, prog_bar=("reward", "loss"))  # for callbacks

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Clip by the global norm measured in ``on_before_optimizer_step`` (correct under
        sharding, and valid for fused optimizers under mixed precision, which Lightning refuses)."""
        clip_gradients_(self.policy.parameters(), gradient_clip_val, gradient_clip_algorithm, self._grad_norm)

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return self.trainer.strategy.reduce(tensor.clone().to(self.device), reduce_op=op)

    def _world_mean(self, value: torch.Tensor) -> torch.Tensor:
        return self._all_reduce(value, "sum") / self.trainer.world_size if self.trainer.world_size > 1 else value

    # ---------------------------------------------------------------------- optimizer
    def configure_optimizers(self) -> dict[str, Any]:
        return build_optimizer(
            [p for p in self.policy.parameters() if p.requires_grad], self.optimizer_factory,
            learning_rate=self.learning_rate, weight_decay=self.weight_decay, lr_scheduler_type=self.lr_scheduler_type,
            warmup_steps=self.warmup_steps, warmup_ratio=self.warmup_ratio,
            total_steps=int(self.trainer.estimated_stepping_batches),
        )

    @property
    def optimizer_state_released(self) -> bool:
        """Whether the trainer's optimizer state was released when training ended."""
        return self._trainer is not None and self._fit_end.released(self.trainer.optimizers)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._fit_end.check_checkpoint(self.trainer.optimizers)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.model_settings.quantization_config is not None:  # QLoRA: the quant state is rebuilt, not loaded
            drop_quantization_state(checkpoint["state_dict"])

    # ------------------------------------------------------------------------- export
    def on_train_end(self) -> None:
        if self.save_final_model:
            self.export(os.path.join(self.output_dir or self.trainer.default_root_dir, "final_model"))
        self._exported_at_step = self.trainer.global_step
        self._fit_end.release(self.parameters(), self.trainer.optimizers)  # before the teardown copies them to the host

    def on_fit_end(self) -> None:
        """A fit resumed from a checkpoint already at ``max_steps`` runs no training loop, so no
        ``on_train_end``: export the restored weights here (a run killed before its export)."""
        done = 0 < self.trainer.max_steps <= self.trainer.global_step
        if self.save_final_model and done and self._exported_at_step != self.trainer.global_step:
            self.export(os.path.join(self.output_dir or self.trainer.default_root_dir, "final_model"))

    def export(self, directory: str) -> None:
        """Save the policy and its tokenizer with ``save_pretrained`` (loadable by transformers).

        Collective under sharding: every rank gathers its shards, global rank 0 writes, and no rank
        returns before the folder is written. A PEFT policy: the merged model in ``directory``, the
        adapter in ``directory/adapter``."""
        state = full_state_dict(self.policy, self._trainer and self.trainer.strategy)
        if self._trainer is None or self.trainer.is_global_zero:
            export_policy(self.policy, state, directory, self.tokenizer, self._load_base,
                          is_peft=self.model_settings.peft_config is not None)
        if self._trainer is not None:
            self.trainer.strategy.barrier("final model exported")  # every rank's fit returns with it on disk

