#!/usr/bin/env bash
# Issue #15's GPU checks, one part per scripts/gpu_check.sh section (docs/gpu.md):
#
#   scripts/gpu/issue15.sh kernels OUT_DIR   # ~3 min: CUDA equality tests of the attention kernels and
#                                            # the LM-head chunk calibration; training pass per kernel
#                                            # on the Qwen2.5-0.5B shape (bf16, 256-token completions)
#   scripts/gpu/issue15.sh bench15 OUT_DIR   # ~5 min: ours vs TRL 1.16, Qwen2.5-0.5B random weights, bf16,
#                                            # G=8, 256 tokens, HF generate on both sides; then our fastest
#                                            # sampler (vllm_colocate where vLLM is installed, else fast_generate)
#   scripts/gpu/issue15.sh learn OUT_DIR     # ~2 min: the arithmetic learning curve (scripts/gpu/learn.py)
#   scripts/gpu/issue15.sh samplers15 OUT_DIR  # ~4 min: each side's other fast sampler: ours and TRL with
#                                            # transformers' continuous batching; the host-RSS loading check
#
# DRY_RUN=1 runs every part on CPU at a tiny size (what this machine can check: the scripts run,
# the files appear); its numbers mean nothing.
set -euo pipefail
cd "$(dirname "$0")/../.."
PART=$1
OUT_DIR=${2:-benchmarks/results}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1

if [ "${DRY_RUN:-0}" = 1 ]; then
  SHAPE="--hidden 64 --layers 2 --heads 4 --vocab 1000 --rows 8 --max-completion 32 --threads 2 --rounds 1 --steps 1"
  KERNEL_PATHS="plain,chunked+packed,chunked+packed/varlen"  # flex has no CPU backward
  BENCH="--device cpu --sizes tiny --repeats 1 --warmup-steps 1 --measured-steps 1"
  LEARN="--tiny"
  HOST_RSS="--device cpu --size tiny --json $OUT_DIR/host_rss_cpu_dry.json"
  TAG=cpu_dry
else
  SHAPE="--device cuda --autocast bf16 --hidden 896 --layers 24 --heads 14 --intermediate 4864 --rows 64 --max-completion 256 --threads 8 --rounds 1 --steps 3"
  KERNEL_PATHS="plain,chunked+packed,chunked+packed/varlen,chunked+packed/flex,chunked+packed+shared,chunked+packed+shared/flex"
  BENCH="--device cuda --sizes qwen0.5b --run-timeout 240 --learning-rate 1e-12"  # same completions on both sides, see issue15_one_call.sh
  LEARN="--steps 100 --eval-every 10"
  HOST_RSS="--device cuda --json $OUT_DIR/host_rss_cuda.json"
  TAG=cuda
fi

case $PART in
  kernels)
    echo "== attention kernels and LM-head calibration on CUDA: equality with the plain path"
    if $PY -c "import pytest" 2> /dev/null; then
      timeout 240 $PY -m pytest -q -m gpu -p no:cacheprovider tests/module/test_attention_kernels_gpu.py || echo "KERNEL TESTS FAILED"
    fi
    echo "== training pass per attention kernel (LM-head chunk auto)"
    timeout 300 $PY benchmarks/forward_paths.py $SHAPE --modes train --paths "$KERNEL_PATHS" --chunk-tokens auto \
      --json "$OUT_DIR/forward_kernels_${TAG}.json" || echo "KERNEL PATHS FAILED"
    ;;
  bench15)
    if [ -z "${GRPO_SHARED_ASSETS:-}" ] && [ -d .gpu_wheels/assets/tokenizers/qwen2.5 ]; then
      export GRPO_SHARED_ASSETS=$PWD/.gpu_wheels/assets
    fi
    echo "== ours vs TRL, HF generate on both sides (the same completions)"
    $PY benchmarks/compare_trl.py $BENCH --sampler hf_generate --impls ours,trl --out-dir "$OUT_DIR" \
      --attention-kernel auto --tag "bench15_${TAG}_hf_generate" || echo "BENCH (hf_generate) FAILED"
    FAST=fast_generate
    if $PY -c "import vllm" 2> /dev/null; then FAST=vllm_colocate; fi
    echo "== ours with its fastest sampler here ($FAST); TRL's fastest without vLLM is the generate run above"
    $PY benchmarks/compare_trl.py $BENCH --sampler $FAST --impls ours --out-dir "$OUT_DIR" \
      --attention-kernel auto --tag "bench15_${TAG}_$FAST" || echo "BENCH ($FAST) FAILED"
    ;;
  samplers15)
    if [ -z "${GRPO_SHARED_ASSETS:-}" ] && [ -d .gpu_wheels/assets/tokenizers/qwen2.5 ]; then
      export GRPO_SHARED_ASSETS=$PWD/.gpu_wheels/assets
    fi
    if compgen -G ".gpu_wheels/transformers/*.whl" > /dev/null; then  # the image's 5.17 predates the engine we drive
      $PY -m pip install -q --no-deps --no-index --target /tmp/transformers_cb .gpu_wheels/transformers/*.whl
      export PYTHONPATH=/tmp/transformers_cb${PYTHONPATH:+:$PYTHONPATH}
    fi
    $PY -c "import transformers; print('transformers', transformers.__version__, 'for continuous batching')"
    echo "== ours and TRL with transformers' continuous batching (TRL's fastest sampler without vLLM)"
    $PY benchmarks/compare_trl.py $BENCH --sampler continuous_batching --trl-generation continuous_batching \
      --impls ours,trl --out-dir "$OUT_DIR" --attention-kernel auto --tag "samplers15_${TAG}_continuous_batching" \
      || echo "BENCH (continuous_batching) FAILED"
    echo "== host RSS of loading the Qwen2.5-0.5B shape and moving it to the device: ours vs from_pretrained"
    timeout 180 $PY benchmarks/host_rss.py $HOST_RSS || echo "HOST RSS CHECK FAILED"
    ;;
  learn)
    echo "== learning curve: two-digit addition, held-out accuracy (scripts/gpu/learn.py)"
    timeout 300 $PY scripts/gpu/learn.py $LEARN --out "$OUT_DIR/learn_${TAG}.json" \
      --plot "$OUT_DIR/learning_curve_${TAG}.png" || echo "LEARN FAILED"
    ;;
  *)
    echo "unknown part $PART: kernels, bench15, learn, samplers15" >&2
    exit 2
    ;;
esac
