"""``GRPODeepSpeedStrategy``: Lightning's DeepSpeed strategy, made to agree with GRPO's step.

Lightning's ``DeepSpeedStrategy`` hands ``trainer.accumulate_grad_batches`` to DeepSpeed as
``gradient_accumulation_steps`` and then lets the engine decide when to step: it calls
``engine.backward`` and ``engine.step`` on every micro-batch. Three things then disagree with the
rest of the package, and this subclass settles each:

* **The loss scale.** Lightning divides the ``training_step`` loss by ``accumulate_grad_batches``
  (which ``GRPOModule`` undoes: its loss is already in TRL's scale) and ``engine.backward`` divides
  it by ``gradient_accumulation_steps`` once more. Here the backward is called with
  ``scale_wrt_gas=False``, as TRL does, so the gradient is the same as under DDP.
* **Which micro-step steps.** The engine counts micro-steps on its own, from the start of the
  run; Lightning counts them per epoch and from a restored checkpoint. Here the engine is told,
  before every micro-step, whether it ends Lightning's accumulation window; an epoch whose
  micro-steps are not a multiple of ``accumulate_grad_batches`` (Lightning would leave its last
  window unstepped under DeepSpeed) is refused before the first generation.
* **The batch size DeepSpeed logs** (its ``train_micro_batch_size_per_gpu``): Lightning reads it
  from the loader's sampler, and the rollout loader has none; it is taken from the datamodule's
  ``per_device_train_batch_size``.

``GRPOModule`` refuses Lightning's plain ``DeepSpeedStrategy`` (``strategy: deepspeed_stage_3``
and friends) for these reasons. Needs the ``[deepspeed]`` extra and a CUDA device.
"""

from __future__ import annotations

import importlib.util
from contextlib import contextmanager
from typing import Any, Generator

from lightning.pytorch.strategies import DeepSpeedStrategy

from grpo_lightning.errors import ConfigError
from grpo_lightning.utils.zero3 import DEEPSPEED_EXTRA

STRATEGY_PATH = "grpo_lightning.module.deepspeed_strategy.GRPODeepSpeedStrategy"


class GRPODeepSpeedStrategy(DeepSpeedStrategy):
    """DeepSpeed ZeRO (stage 1, 2 or 3) for GRPO; every argument of Lightning's
    ``DeepSpeedStrategy`` (``stage``, ``offload_optimizer``, ``offload_parameters``, ``config``, ...)
    is accepted as well. The shipped recipes: ``configs/strategy/deepspeed_zero2.yaml``,
    ``configs/strategy/deepspeed_zero3.yaml``; see ``docs/strategies.md``.

    Args:
        ds3_gather_for_generation: ZeRO-3 only (TRL's field of the same name). ``true``: the
            policy's parameters are gathered once around each generation (fast; the whole policy
            must fit on one GPU next to the training state). ``false``: the policy generates with
            its parameters sharded, each layer's weights fetched at every forward (slow, but a
            policy larger than one GPU can generate; only the ``hf_generate`` sampler keeps the
            ranks' forwards in step for that). Pushes into vLLM always gather, one tensor at a
            time, whatever this says.
    """

    def __init__(self, *, ds3_gather_for_generation: bool = True, **kwargs: Any) -> None:
        if importlib.util.find_spec("deepspeed") is None:
            raise ImportError(f"trainer.strategy={type(self).__name__} needs DeepSpeed: {DEEPSPEED_EXTRA}.")
        super().__init__(**kwargs)
        self.ds3_gather_for_generation = ds3_gather_for_generation
        self._transformers_zero3: Any = None  # keeps transformers' ZeRO-3 loading switched on

    # ----------------------------------------------------------------- model building
    @contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Lightning's ``deepspeed.zero.Init`` context, plus transformers' own ZeRO-3 switch
        (``HfDeepSpeedConfig``) under stage 3: without it ``from_pretrained`` copies the
        checkpoint into the empty parameter placeholders and fails. The switch stays on for the
        run (``generate`` then keeps the ranks' forwards in step)."""
        with super().model_sharded_context():
            if self.zero_stage_3 and self._transformers_zero3 is None:
                from transformers.integrations import HfDeepSpeedConfig

                self._transformers_zero3 = HfDeepSpeedConfig(self.config)
            yield

    def _auto_select_batch_size(self) -> int:
        datamodule = getattr(self.lightning_module.trainer, "datamodule", None) if self.lightning_module else None
        return int(getattr(datamodule, "per_device_train_batch_size", 1) or 1)

    # ---------------------------------------------------------------------- training
    def setup(self, trainer: Any) -> None:
        if trainer.training:
            check_whole_windows(trainer)
        super().setup(trainer)

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        engine = self.model
        if hasattr(engine, "set_gradient_accumulation_boundary"):
            # Lightning's own decision for this micro-step (its automatic loop asks the same).
            engine.set_gradient_accumulation_boundary(not self.lightning_module.trainer.fit_loop._should_accumulate())
        return super().training_step(*args, **kwargs)

    def backward(self, closure_loss: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        """The engine's backward without its division by ``gradient_accumulation_steps``
        (Lightning has divided by ``accumulate_grad_batches`` already)."""
        kwargs.setdefault("scale_wrt_gas", False)
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def teardown(self) -> None:
        super().teardown()
        self._transformers_zero3 = None


def check_whole_windows(trainer: Any) -> None:
    """Refuse an epoch that ends inside an accumulation window: Lightning steps the optimizer at
    an epoch's end, but not under DeepSpeed, whose engine would carry the window's gradients into
    the next epoch while the step's normalisers count only the micro-steps it had."""
    accumulate = trainer.accumulate_grad_batches
    if accumulate == 1:
        return
    trainer.fit_loop.setup_data()
    batches = trainer.num_training_batches
    if batches != float("inf") and int(batches) % accumulate:
        raise ConfigError(
            f"trainer.accumulate_grad_batches={accumulate} does not divide an epoch's {int(batches)} micro-steps, "
            "which DeepSpeed cannot step (its engine would merge the last window of an epoch into the next). "
            f"Choose trainer.accumulate_grad_batches dividing {int(batches)} (e.g. equal to data.steps_per_generation), "
            "or change the dataset size, data.per_device_train_batch_size or trainer.limit_train_batches."
        )
