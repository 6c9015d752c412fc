#!/usr/bin/env bash
# The project's GPU checks on a lent CUDA machine (docs/benchmarks.md "GPU").
#
#   scripts/gpu_wheels.sh                      # here, once: wheels + tokenizer into .gpu_wheels/
#   SECTIONS=smoke,paths scripts/gpu_check.sh  # device call 1 (carry .gpu_wheels), ~4 min
#   SECTIONS=bench scripts/gpu_check.sh        # device call 2, ~6 min
#   SECTIONS=strategies scripts/gpu_check.sh   # device call 3 (carry .gpu_wheels with DeepSpeed's), ~5 min
#
# Sections (default: all, in this order; a device command may run 10 minutes at most):
#   smoke  bf16-mixed quickstart on CUDA, every loss type with a reference model, prefix sharing
#   paths  forward paths (plain / chunked / packed / shared, token budgets, LM-head chunk sizes)
#          on the Qwen2.5-0.5B shape: answers the open GPU questions of docs/benchmarks.md
#   bench  ours vs TRL GRPOTrainer end to end (Qwen2.5-0.5B architecture, bf16, 256 tokens)
#   memory the memory plan's estimate against torch.cuda.max_memory_allocated of real steps
#          (benchmarks/memory_plan_check.py --device cuda; docs/memory.md)
#   vllm   both vLLM modes on the GPU (scripts/vllm_modes.py): colocated engine and a `vllm serve`
#          subprocess with the NCCL weight transfer, real verified pushes, completion tokens/s per
#          mode; needs vLLM on the machine (the H200 image has none and a CUDA vLLM wheel with its
#          torch is far over a device call's 64 MiB carry, so it prints why it skipped there)
#   strategies  each configs/strategy/ recipe (fsdp, deepspeed_zero2, deepspeed_zero3 with
#          ds3_gather_for_generation on and off) and a single-device baseline, a few bf16 steps of a
#          ~150M random Llama on one GPU (scripts/gpu_strategies.py): step time, peak memory,
#          loss/reward/grad_norm, the export loaded with AutoModelForCausalLM; then the GPU-marked
#          training of the recipes (tests/test_configs.py, needs jsonargparse and mlflow there).
#          The image has no DeepSpeed: carry it (a py3-none-any wheel built here) and what it needs:
#            DS_BUILD_OPS=0 .venv/bin/pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .gpu_wheels
#            python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#              --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu_wheels \
#              hjson pydantic pydantic-core annotated-types typing-inspection
#          without them the DeepSpeed runs print that they were skipped
#   kernels, bench15, learn, samplers15  issue #15 (scripts/gpu/issue15.sh, docs/gpu.md; not in the
#          default list): attention kernels' CUDA equality tests + training pass per kernel; ours vs
#          TRL with HF generate on both sides, then our fastest sampler; the arithmetic learning
#          curve; then (second call) both sides with continuous batching and the host-RSS loading check.
#            SECTIONS=kernels,bench15,learn BENCH_OUT_DIR=$OUT scripts/gpu_check.sh   # ~9 min
#            SECTIONS=samplers15,strategies BENCH_OUT_DIR=$OUT scripts/gpu_check.sh   # ~9 min
# Results go to $BENCH_OUT_DIR (default benchmarks/results; on the device machine use $OUT).
# The machine has no package index: wheels it lacks are carried in .gpu_wheels/ (made by
# `scripts/gpu_wheels.sh`, git-ignored) and installed without dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SECTIONS=${SECTIONS:-smoke,paths,bench,memory,vllm,strategies}
OUT_DIR=${BENCH_OUT_DIR:-benchmarks/results}
mkdir -p "$OUT_DIR"
if compgen -G ".gpu_wheels/*.whl" > /dev/null; then
  $PY -m pip install -q --no-deps --no-index .gpu_wheels/*.whl
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, lightning, transformers; print('torch', torch.__version__, 'lightning', lightning.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"

if [[ ,$SECTIONS, == *,smoke,* ]]; then
  echo "== training loop on CUDA (bf16-mixed quickstart, every loss type with a reference model)"
  PYTHONUNBUFFERED=1 $PY scripts/gpu_smoke.py
  echo "== CUDA-only tests (bf16 forward paths, prefix sharing under autocast, reward model on CUDA)"
  if $PY -c "import pytest" 2> /dev/null; then
    PYTHONUNBUFFERED=1 $PY -m pytest -q -m gpu -p no:cacheprovider tests/module tests/rewards || echo "GPU TESTS FAILED"
  else
    echo "pytest is not installed here: scripts/gpu_wheels.sh carries it"
  fi
fi

if [[ ,$SECTIONS, == *,paths,* ]]; then
  echo "== forward paths on CUDA (Qwen2.5-0.5B architecture, bf16 autocast, 256-token completions, 8 samples per prompt)"
  # Does sdpa packing (an explicit mask: no flash kernel) cost more than the padding it saves; does
  # sharing the prompt pay; what LM-head chunk size suits the GPU; what a train_token_budget costs.
  QWEN05="--device cuda --autocast bf16 --hidden 896 --layers 24 --heads 14 --intermediate 4864 --rows 32 --max-completion 256 --threads 8 --rounds 1 --steps 3"
  PYTHONUNBUFFERED=1 $PY benchmarks/forward_paths.py $QWEN05 --json "$OUT_DIR/forward_paths_cuda.json"
  for chunk in 4096 16384; do
    PYTHONUNBUFFERED=1 $PY benchmarks/forward_paths.py $QWEN05 --modes train --paths chunked+packed+shared --chunk-tokens $chunk
  done
fi

if [[ ,$SECTIONS, == *,bench,* ]]; then
  echo "== benchmark: ours vs TRL GRPOTrainer (Qwen2.5-0.5B architecture from a config, bf16, 256-token completions, HF generate)"
  # Writes cuda.md / cuda.json to $OUT_DIR. No mlflow/jsonargparse needed.
  if [ -z "${GRPO_SHARED_ASSETS:-}" ] && [ -d .gpu_wheels/assets/tokenizers/qwen2.5 ]; then
    export GRPO_SHARED_ASSETS=$PWD/.gpu_wheels/assets  # the Qwen2.5 tokenizer copied by gpu_wheels.sh
  fi
  PYTHONUNBUFFERED=1 $PY benchmarks/compare_trl.py --device cuda --sizes qwen0.5b --out-dir "$OUT_DIR" ${BENCH_ARGS:-}
fi

if [[ ,$SECTIONS, == *,memory,* ]]; then
  echo "== memory plan vs measured peaks on CUDA (writes memory_plan_cuda.md)"
  PYTHONUNBUFFERED=1 $PY benchmarks/memory_plan_check.py --device cuda --threads 4 --out "$OUT_DIR/memory_plan_cuda.md" || echo "MEMORY CHECK FAILED"
fi

if [[ ,$SECTIONS, == *,vllm,* ]]; then
  echo "== vLLM colocate and server modes on CUDA (random Qwen2 hidden 512 x 8 layers, 16 prompts x 8, 128 tokens)"
  PYTHONUNBUFFERED=1 $PY scripts/vllm_modes.py --device cuda --json "$OUT_DIR/vllm_modes_cuda.json"
fi

if [[ ,$SECTIONS, == *,strategies,* ]]; then
  echo "== GPU strategies: single / fsdp / zero2 / zero3 (gather on, off), bf16, ~150M Llama, 4 steps each (writes strategies_cuda.json)"
  $PY -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2> /dev/null || echo "deepspeed is not installed: the zero* runs are skipped (see the header)"
  PYTHONUNBUFFERED=1 $PY scripts/gpu_strategies.py --out-dir "$OUT_DIR" ${STRATEGY_ARGS:-} || echo "STRATEGY CHECK FAILED"
  echo "== the strategy recipes through grpo fit (tests/test_configs.py -m gpu)"
  if $PY -c "import pytest, jsonargparse, mlflow" 2> /dev/null; then
    PYTHONUNBUFFERED=1 $PY -m pytest -q -m gpu -p no:cacheprovider tests/test_configs.py -k strategy_config || echo "STRATEGY CONFIG TESTS FAILED"
  else
    echo "pytest, jsonargparse or mlflow is missing here: the grpo fit runs of the recipes are skipped"
  fi
fi

for part in kernels bench15 learn samplers15; do  # issue #15: the logic is in scripts/gpu/issue15.sh
  if [[ ,$SECTIONS, == *,$part,* ]]; then PYTHON=$PY bash scripts/gpu/issue15.sh "$part" "$OUT_DIR"; fi
done
