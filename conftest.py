"""Root pytest configuration: doctest collection (``--doctest-modules`` imports every module under
the test paths) skips the modules that exist only to run where an optional back-end is installed
and import it at module level: vLLM's engine-side plugin, and the DeepSpeed rank script."""

import importlib.util

collect_ignore = []
if not importlib.util.find_spec("vllm"):
    collect_ignore.append("grpo_lightning/samplers/vllm_gloo_engine.py")
if not importlib.util.find_spec("deepspeed"):
    collect_ignore.append("tests/module/deepspeed_zero3_child.py")
