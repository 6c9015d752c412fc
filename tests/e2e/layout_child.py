"""Every loss type's one-step update under 2-process DDP (gloo), for test_layout_invariance.py.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/e2e/layout_child.py \
        <model_dir> <prompts> <out_dir> <loss_type,...> <processes:rows:steps,...>

One process per rank for the whole launch; each (loss type, layout) is one ``Trainer.fit`` in
turn (the process group is created by the first and reused). Rank 0 saves the updated policy to
``<out_dir>/<loss>_<layout>.pt``; every rank saves its completions and sizes next to it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.e2e.layouts import Layout, make_loss, train_one_step  # noqa: E402


def main(model_dir: str, prompts: str, out_dir: str, loss_types: str, layouts: str) -> None:
    out = Path(out_dir)
    for spec in layouts.split(","):
        layout = Layout(*(int(x) for x in spec.split(":")))
        for loss_type in loss_types.split(","):
            name = f"{loss_type}_{spec.replace(':', 'x')}"
            weights, completions, sizes = train_one_step(
                model_dir, prompts, make_loss(loss_type), layout, str(out / "runs"),
                devices=layout.processes, strategy="ddp",
            )
            rank = torch.distributed.get_rank()
            if rank == 0:
                torch.save(weights, out / f"{name}.pt")
            (out / f"{name}_rank{rank}.json").write_text(json.dumps({"completions": completions, "sizes": sizes}))


if __name__ == "__main__":
    main(*sys.argv[1:])
