"""The ``trainer.accelerator`` a config asks for, checked against the machine before anything loads.

Layer L6. Lightning reports a missing GPU from deep in its accelerator connector, as a traceback
that never names the setting; a config written for a GPU machine and run on a laptop should get
one line saying which setting to change.
"""

from __future__ import annotations

from typing import Any

from grpo_lightning.errors import ConfigError

_CUDA_NAMES = ("gpu", "cuda")


def check_accelerator(accelerator: Any) -> None:
    """Raise a :class:`ConfigError` when ``accelerator`` (a name) needs a CUDA device this machine lacks."""
    if not isinstance(accelerator, str) or accelerator.lower() not in _CUDA_NAMES:
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.accelerator={accelerator}: this machine has no CUDA device. Use --trainer.accelerator cpu "
            "(or auto, which picks the GPU where there is one), and precision 32-true or bf16-mixed for a CPU run."
        )
