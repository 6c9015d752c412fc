"""Cast each weight to 16 bits once per generation, not once per decode step.

Under ``*-mixed`` precision every matmul runs on a 16-bit copy of its fp32 weight. PyTorch's
autocast can keep those copies for the life of the outermost autocast region (its *weight-cast
cache*: the casts of float32 leaf tensors that require grad, i.e. the trainable weights), but
Lightning's ``MixedPrecision`` plugin opens autocast with ``cache_enabled=False``. Inside
``transformers`` ``generate`` that means every decode step casts every weight again: one extra
kernel per weight per token: on Qwen2.5-0.5B 241 casts a decode step (every linear's weight and
the q/k/v biases; ~3 GB of memory traffic), about a fifth of the kernels the step runs. On CPU
that was ~40 % of a small model's decode step (docs/benchmarks.md).

:func:`reused_weight_casts` turns the cache on for one block (a whole generation request) and
empties it on the way out. The numbers are unchanged (a cast is deterministic; the cached copy is
the copy each step would have made); the cost is memory: a 16-bit copy of the trainable weights
while the block runs (counted by the memory plan, ``docs/memory.md``). Frozen weights (a PEFT
base model) are never cached by autocast and keep being cast per step.

Layer L0: torch only.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def reused_weight_casts(device: torch.device | str, enabled: bool = True) -> Iterator[None]:
    """Within the block, autocast casts each trainable weight once and reuses the copy.

    A no-op when ``enabled`` is false, when autocast is off for ``device``'s type (fp32, ``*-true``
    precision, FSDP/DeepSpeed casting the weights themselves) or when an enclosing autocast region
    already caches (its cache is then left alone). Otherwise the block runs under the same autocast
    dtype with the cache on, and the cache is cleared when it ends, also on error, so no 16-bit copy
    outlives it and a later weight update can never meet a stale copy.
    """
    device_type = torch.device(device).type
    if not enabled or not torch.is_autocast_enabled(device_type) or torch.is_autocast_cache_enabled():
        yield
        return
    try:
        with torch.autocast(device_type, dtype=torch.get_autocast_dtype(device_type), cache_enabled=True):
            yield
    finally:
        # Leaving a nested autocast region does not empty the cache (only the outermost does).
        torch.clear_autocast_cache()
