"""Helpers of the real-vLLM tests: one engine or connection per test module, fresh pushes."""

from __future__ import annotations

from contextlib import contextmanager


@contextmanager
def held_open(sampler):
    """``sampler`` with ``close`` held back until the block ends (one engine or connection serves a
    whole test module: starting one costs seconds); it serves nothing once closed."""
    real_close = sampler.close
    sampler.close = lambda: None
    try:
        yield sampler
    finally:
        real_close()
        assert sampler.served_version is None


def pushed_module(model_dir, sampler):
    """A built GRPOModule outside a trainer (policy version 0), bound to ``sampler`` and pushed:
    every test starts from a full push, never from what another test left in the engine."""
    from grpo_lightning.module import GRPOModule
    from tests.helpers import built

    module = built(GRPOModule(model_dir, save_final_model=False))
    sampler.bind(module)
    sampler.on_policy_updated(module, 0)
    return module
