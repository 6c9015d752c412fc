#!/usr/bin/env bash
# The project's GPU checks, as one short run on a lent CUDA machine (see README "GPU").
# The machine has no package index: wheels it lacks are carried in .gpu_wheels/ (made by
# `scripts/gpu_wheels.sh`, git-ignored) and installed without dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if compgen -G ".gpu_wheels/*.whl" > /dev/null; then
  $PY -m pip install -q --no-deps --no-index .gpu_wheels/*.whl
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$PY -c "import torch, lightning, transformers; print('torch', torch.__version__, 'lightning', lightning.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
echo "== training loop on CUDA (bf16-mixed quickstart, every loss type with a reference model)"
PYTHONUNBUFFERED=1 $PY scripts/gpu_smoke.py
