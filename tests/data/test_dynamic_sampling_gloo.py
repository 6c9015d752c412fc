"""Dynamic sampling across two real processes (gloo): both ranks take the same drop/refill
decisions, train the same number of rows and the groups a single process trains, with the
rollouts of a group moved to the rank that trains it. The collective is ``trainer_collective``,
the one the datamodule uses, over a trainer-like object whose strategy gathers with gloo."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.data.test_dynamic_sampling import KINDS, OccurrenceSampler, make_sampler, trained_prompts
from tests.helpers import free_port

STRADDLING_KINDS = ["vary", "tie", "tie", "tie", "tie", "vary", "tie", "vary"] + ["vary"] * 4
CASES = {"whole": dict(groups=4, num_generations=2, kinds=KINDS),  # 4 rows per rank
         "straddling": dict(groups=3, num_generations=4, kinds=STRADDLING_KINDS)}  # 6 rows: a group on both ranks


def _gather(tensor: torch.Tensor) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, tensor.contiguous())
    return torch.stack(parts)  # (P, ...) like Lightning's strategy.all_gather


def _rank(rank: int, port: int, out: str) -> None:
    from grpo_lightning.data.collective import trainer_collective

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    trainer = SimpleNamespace(global_rank=rank, world_size=2, strategy=SimpleNamespace(all_gather=_gather))
    results = {}
    for name, case in CASES.items():
        dynamic, order = make_sampler(trainer_collective(lambda: trainer), sampler_class=OccurrenceSampler, **case)
        batches = [dynamic.build(order, None).micro_batches[0] for _ in range(2)]
        tokenizer = dynamic.builder.handle.tokenizer
        results[name] = {
            "prompts": [trained_prompts([b], tokenizer) for b in batches], "rows": [len(b) for b in batches],
            "advantages": [b.advantages for b in batches], "metrics": [b.generation_metrics for b in batches],
            "num_items": [float(b.num_items_in_batch) for b in batches],
            "loss_tokens": [float(b.loss_mask.sum()) for b in batches], "drawn": dynamic.batches_drawn,
        }
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_gloo_processes_agree_with_one(tmp_path):
    mp.start_processes(_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True, start_method="fork")
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for name, case in CASES.items():
        single, order = make_sampler(sampler_class=OccurrenceSampler, **case)
        alone = [single.build(order, None).micro_batches[0] for _ in range(2)]
        first, second = ranks[0][name], ranks[1][name]
        for i, batch in enumerate(alone):
            assert first["rows"][i] == second["rows"][i] == len(batch) // 2, name
            both = first["prompts"][i] + second["prompts"][i]
            assert both == trained_prompts([batch], single.builder.handle.tokenizer), (name, i)
            assert first["metrics"][i] == second["metrics"][i], (name, i)
            assert first["num_items"][i] == second["num_items"][i] == first["loss_tokens"][i] + second["loss_tokens"][i]
            for metric, value in batch.generation_metrics.items():
                if metric.startswith("dynamic_sampling/"):
                    assert first["metrics"][i][metric] == value, (name, i, metric)
            if name == "whole":  # the same rows as one process generates: the same batch, split in two
                assert torch.equal(torch.cat([first["advantages"][i], second["advantages"][i]]), batch.advantages)
        assert first["drawn"] == second["drawn"] == single.batches_drawn
