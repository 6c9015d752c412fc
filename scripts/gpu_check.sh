#!/usr/bin/env bash
# The project's GPU checks on a lent CUDA machine (docs/benchmarks.md "GPU").
#
#   scripts/gpu_wheels.sh                      # here, once: wheels + tokenizer into .gpu_wheels/
#   SECTIONS=smoke,paths scripts/gpu_check.sh  # device call 1 (carry .gpu_wheels), ~4 min
#   SECTIONS=bench scripts/gpu_check.sh        # device call 2, ~6 min
#
# Sections (default: all three, in this order; a device command may run 10 minutes at most):
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
# Results go to $BENCH_OUT_DIR (default benchmarks/results; on the device machine use $OUT).
# The machine has no package index: wheels it lacks are carried in .gpu_wheels/ (made by
# `scripts/gpu_wheels.sh`, git-ignored) and installed without dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
SECTIONS=${SECTIONS:-smoke,paths,bench,memory,vllm}
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
