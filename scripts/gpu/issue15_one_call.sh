#!/usr/bin/env bash
# Issue #15's GPU checks in ONE device call, most important first, each part cut to what is left
# of a deadline, so a 15-minute lease (machine start included) returns every result it reached:
#
#   bash scripts/gpu_wheels.sh                                   # here, once (jsonargparse is among the wheels:
#                                                                # grpo_lightning imports it, the image lacks it)
#   device run, carry [".gpu_wheels"], timeout_s 600:
#     DEADLINE_S=540 bash scripts/gpu/issue15_one_call.sh $OUT
#
# Order: ours vs TRL with HF generate (the headline) -> the learning curve -> the attention-kernel
# CUDA tests -> the training pass per kernel -> ours with HF generate on a static cache, compiled (only
# when named) -> ours with fast_generate -> ms per decode step per precision set-up -> the host-RSS loading
# check -> continuous batching on both sides (only if time is left). Every part logs to
# OUT/log.txt as it runs; the result files are packed into OUT/results.tgz at the end (a device
# call returns at most 8 files). A part that fails or runs out of time prints `... FAILED` or
# `... SKIPPED` and the next one runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: issue15_one_call.sh OUT_DIR}
PY=${PYTHON:-python3}
DEADLINE=$(( $(date +%s) + ${DEADLINE_S:-540} ))
RESULTS=/tmp/issue15_results
mkdir -p "$OUT" "$RESULTS"
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1

left() { echo $(( DEADLINE - $(date +%s) )); }
PARTS=${PARTS:-hf,learn,kernel_tests,kernel_pass,fast,decode,rss,cb}  # a rerun names only what is missing
# step KEY NAME CAP_S MIN_S COMMAND...: run COMMAND under timeout min(CAP_S, time left); skip it when
# KEY is not in PARTS or fewer than MIN_S seconds are left.
step() {
  local key=$1 name=$2 cap=$3 min=$4; shift 4
  [[ ,$PARTS, == *,$key,* ]] || return 0
  local budget; budget=$(left)
  if (( budget < min )); then echo "== $name SKIPPED: ${budget}s left, needs ${min}s"; return; fi
  (( budget > cap )) && budget=$cap
  echo "== $name (up to ${budget}s; $(date -u +%T))"
  local t0; t0=$(date +%s)
  timeout "$budget" "$@" || echo "$name FAILED (rc=$?)"
  echo "== $name took $(( $(date +%s) - t0 ))s"
}

if compgen -G ".gpu_wheels/*.whl" > /dev/null; then
  $PY -m pip install -q --no-deps --no-index .gpu_wheels/*.whl
fi
[ -d .gpu_wheels/assets/tokenizers/qwen2.5 ] && export GRPO_SHARED_ASSETS=$PWD/.gpu_wheels/assets
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, transformers, trl; print('torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__, 'cuda', torch.cuda.is_available())"

# --learning-rate 1e-12: the optimizer does all its work, but an update of ~1e-12 is below half a
# float32 ulp of any weight larger than ~1e-5, so the weights stay put and both sides sample the same
# completions every step (0 itself is refused by model.learning_rate's check). Run 2 used 1e-5: the
# random bf16 model's EOS bias drifted apart after step 0 and TRL generated up to 10x the tokens ours
# did; a ratio over different work is not a ratio.
BENCH="--device cuda --sizes qwen0.5b --attention-kernel auto --learning-rate 1e-12 --out-dir $RESULTS"
# Paired, every step generates what run 2's warm-up did (5,615 tokens, up to 256 a row: ~23 s a
# step a side), so each side needs ~100-130 s with loading and flex's compile.
step hf "bench15: ours vs TRL, HF generate on both sides" 400 120 \
  $PY benchmarks/compare_trl.py $BENCH --sampler hf_generate --impls ours,trl --run-timeout 190 \
  --tag bench15_cuda_hf_generate
step learn "learn: two-digit addition, held-out accuracy" 110 60 \
  $PY scripts/gpu/learn.py --steps 100 --eval-every 10 --max-seconds 70 \
  --out "$RESULTS/learn_cuda.json" --plot "$RESULTS/learning_curve_cuda.png"
step kernel_tests "kernels: CUDA equality tests of the attention kernels" 100 40 \
  $PY -m pytest -q -m gpu -p no:cacheprovider tests/module/test_attention_kernels_gpu.py
# Shared-prompt paths first: run 2 measured the others and ran out of time before these.
step kernel_pass "kernels: training pass per attention kernel, Qwen2.5-0.5B shape, bf16, 64 rows x 256 tokens" 130 60 \
  $PY benchmarks/forward_paths.py --device cuda --autocast bf16 --hidden 896 --layers 24 --heads 14 \
  --intermediate 4864 --rows 64 --max-completion 256 --threads 8 --rounds 1 --steps 3 --modes train \
  --paths "chunked+packed+shared,chunked+packed+shared/flex,chunked+packed/flex,plain,chunked+packed" \
  --chunk-tokens auto --json "$RESULTS/forward_kernels_cuda.json"
# Not in the default PARTS: an experiment, HF generate with a static KV cache and transformers'
# compiled decode step (CUDA graphs), for the loop that is ~90 % of a paired step on both sides.
step hf_static "bench15: ours with HF generate, static cache, compiled decode" 200 120 \
  $PY benchmarks/compare_trl.py $BENCH --sampler hf_generate --impls ours --run-timeout 190 \
  --generation-kwargs '{"cache_implementation": "static", "disable_compile": false}' --tag bench15_cuda_hf_static
step fast "bench15: ours with fast_generate" 90 60 \
  $PY benchmarks/compare_trl.py $BENCH --sampler fast_generate --impls ours --run-timeout 80 \
  --tag bench15_cuda_fast_generate
# ms per HF decode step at the real shape, eager (fp32, autocast, autocast + cast cache) against the
# compiled static-cache step: how much of the host-bound loop the precision set-up and CUDA graphs move.
step decode "decode step: ms per HF generate decode step per precision set-up, Qwen2.5-0.5B shape" 150 60 \
  $PY benchmarks/decode_step_cost.py --device cuda --hidden 896 --heads 14 --intermediate 4864 --vocab 151936 \
  --rows 64 --new-tokens 32 --repeats 3 --threads 8 --modes fp32,autocast,autocast+cast_cache,autocast+static_compiled \
  --out "$RESULTS/decode_step_cost_cuda"
step rss "host RSS: loading the Qwen2.5-0.5B shape and moving it to the GPU" 70 40 \
  $PY benchmarks/host_rss.py --device cuda --json "$RESULTS/host_rss_cuda.json"
if compgen -G ".gpu_wheels/transformers/*.whl" > /dev/null; then  # continuous batching needs transformers >= 5.18
  $PY -m pip install -q --no-deps --no-index --target /tmp/transformers_cb .gpu_wheels/transformers/*.whl
  PYTHONPATH=/tmp/transformers_cb${PYTHONPATH:+:$PYTHONPATH} step cb "samplers15: continuous batching, ours and TRL" 200 150 \
    $PY benchmarks/compare_trl.py $BENCH --sampler continuous_batching --trl-generation continuous_batching \
    --impls ours,trl --run-timeout 90 --tag samplers15_cuda_continuous_batching
fi
# Each benchmark child's own result and log too: a report cut off by the deadline keeps its finished runs.
mkdir -p "$RESULTS/runs"
for f in /tmp/grpo_bench_*/*/*/result.json /tmp/grpo_bench_*/*/*/log.txt; do
  [ -f "$f" ] && cp "$f" "$RESULTS/runs/$(echo "${f#/tmp/}" | tr '/' '_')"
done
tar czf "$OUT/results.tgz" -C "$RESULTS" . && echo "== packed: $(tar tzf "$OUT/results.tgz" | tr '\n' ' ')"
