#!/usr/bin/env bash
# Download the pure-python wheels that the GPU machine's image lacks into .gpu_wheels/.
# pytest runs the CUDA-only tests; trl (pinned as in the [dev] extra) and accelerate are for the ours-vs-TRL benchmark
# (benchmarks/compare_trl.py --device cuda); trl's other dependencies (pandas, pyarrow, psutil,
# xxhash, ...) were found on the H200 image.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu_wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 -d .gpu_wheels datasets dill "multiprocess" "trl==1.16.0" accelerate jsonargparse \
  pytest pluggy iniconfig pygments
# DeepSpeed for the `strategies` section (a py3-none-any wheel built here; no ops compiled) and
# the pure-python/binary wheels it needs that the image lacks.
DS_BUILD_OPS=0 .venv/bin/pip wheel -q --no-deps --no-build-isolation deepspeed==0.19.8 -w .gpu_wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu_wheels \
  hjson pydantic pydantic-core annotated-types typing-inspection
# transformers as `make test` runs it, for `samplers15` only (its continuous batching needs >= 5.18;
# the image has 5.17). A subfolder: gpu_check.sh's install of .gpu_wheels/*.whl leaves it out.
TF_VERSION=$(.venv/bin/python -c "import transformers; print(transformers.__version__)")
# With the versions of the libraries it checks at import (huggingface_hub >= 2.4, tokenizers,
# safetensors, regex) and `kernels`, as this machine's `make test` venv has them: they go into the
# same --target folder and shadow the image's for that part only.
PINS=$(.venv/bin/python -c "import importlib.metadata as m; print(' '.join(f'{p}=={m.version(p)}' for p in ('huggingface_hub', 'tokenizers', 'safetensors', 'regex', 'kernels', 'hf_xet')))")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu_wheels/transformers \
  "transformers==$TF_VERSION" $PINS
# The real Qwen2.5 tokenizer for the benchmark (the GPU machine has no ../shared/assets):
# gpu_check.sh points GRPO_SHARED_ASSETS at this copy.
SHARED=${GRPO_SHARED_ASSETS:-../shared/assets}
if [ -d "$SHARED/tokenizers/qwen2.5" ]; then
  mkdir -p .gpu_wheels/assets/tokenizers
  cp -r "$SHARED/tokenizers/qwen2.5" .gpu_wheels/assets/tokenizers/
fi
ls -la .gpu_wheels
