"""Root pytest configuration: doctest collection of the package skips the modules that exist
only to run inside a vLLM process (they import vLLM at module level) when vLLM is absent."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("vllm") else ["grpo_lightning/samplers/vllm_gloo_engine.py"]
