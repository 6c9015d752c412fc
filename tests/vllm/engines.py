"""Helpers of the real-vLLM tests: one engine or connection per test module, fresh pushes, a
``vllm serve`` process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

SERVER_START_TIMEOUT_S = 420.0


@contextmanager
def vllm_server(model_dir: str, log: Path, *extra_args: str, env: dict[str, str] | None = None) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a running ``vllm serve`` of ``model_dir`` on this machine's CPU
    (dev mode, ``processed_logprobs``, the ``gloo`` weight transfer, ``extra_args`` appended); its
    output goes to ``log``; the process group is killed when the block ends."""
    import pytest

    from grpo_lightning.samplers.vllm_server_client import VLLMServerClient
    from tests.helpers import free_port

    port = free_port()
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
               "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
               "--weight-transfer-config", '{"backend": "gloo"}', *extra_args]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        start = time.perf_counter()
        try:
            VLLMServerClient(url).wait_until_up(SERVER_START_TIMEOUT_S, poll_s=1.0)
        except Exception:
            pytest.fail(f"vllm serve did not come up; its log:\n{log.read_text()[-4000:]}")
        print(f"\nvllm serve up in {time.perf_counter() - start:.1f} s")
        yield url
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


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


def server_sampler(url: str, sync_timeout_s: float = 60.0):
    """A ``VLLMServerSampler`` of the test server at ``url`` (``gloo`` transport, a free group port)."""
    from grpo_lightning.samplers.vllm_server import VLLMServerSampler
    from tests.helpers import free_port

    return VLLMServerSampler(base_url=url, weight_transfer_backend="gloo", group_port=free_port(),
                             sync_timeout_s=sync_timeout_s, request_timeout_s=120.0)


def pushed_module(model_dir, sampler):
    """A built GRPOModule outside a trainer (policy version 0), bound to ``sampler`` and pushed:
    every test starts from a full push, never from what another test left in the engine."""
    from grpo_lightning.module import GRPOModule
    from tests.helpers import built

    module = built(GRPOModule(model_dir, save_final_model=False))
    sampler.bind(module)
    sampler.on_policy_updated(module, 0)
    return module
