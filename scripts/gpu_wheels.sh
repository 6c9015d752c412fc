#!/usr/bin/env bash
# Download the pure-python wheels that the GPU machine's image lacks into .gpu_wheels/.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .gpu_wheels
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 -d .gpu_wheels datasets dill "multiprocess" 
ls -la .gpu_wheels
