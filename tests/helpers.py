"""Shared test helpers: a tiny model on disk, prompt files and simple reward functions."""

from __future__ import annotations

import json
from pathlib import Path

from lightning.pytorch.loggers.logger import Logger

from grpo_lightning.utils.ports import free_port  # noqa: F401  (re-exported for the tests)
from grpo_lightning.utils.tiny_models import build_char_tokenizer, build_tiny_causal_lm

ALPHABET = "0123456789+=abc "


class MemoryLogger(Logger):
    """A logger that keeps every ``log_metrics`` call: ``rows`` of ``(step, metrics)``."""

    name, version = "memory", 0

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, dict]] = []

    def log_metrics(self, metrics, step=None):
        self.rows.append((step, dict(metrics)))

    def log_hyperparams(self, params, *args, **kwargs):
        pass

    def by_step(self) -> dict[int, dict]:
        """Every step's metrics, merged over the calls at that step."""
        merged: dict[int, dict] = {}
        for step, metrics in self.rows:
            merged.setdefault(step, {}).update(metrics)
        return merged


def make_model_dir(path: Path, architecture: str = "llama", seed: int = 0) -> str:
    """Save a tiny random causal LM and its char tokenizer to ``path``; return the path."""
    tokenizer = build_char_tokenizer(ALPHABET)
    model = build_tiny_causal_lm(len(tokenizer), architecture=architecture, seed=seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def write_prompts(path: Path, num_rows: int = 24, conversational: bool = False) -> str:
    """A jsonl file of ``a+b=`` prompts with an ``answer`` column."""
    with open(path, "w") as f:
        for i in range(num_rows):
            a, b = i % 10, (3 * i) % 10
            prompt = [{"role": "user", "content": f"{a}+{b}="}] if conversational else f"{a}+{b}="
            f.write(json.dumps({"prompt": prompt, "answer": str(a + b)}) + "\n")
    return str(path)


def fit_config(root: Path, *, trainer: dict | None = None, model: dict | None = None, data: dict | None = None,
               **top) -> dict:
    """A tiny ``grpo fit`` config under ``root``: one CPU step of a fresh tiny model on ``a+b=``
    prompts (groups of 4, 8 completions a micro-batch, 4 new tokens), no progress bar. ``trainer``,
    ``model`` and ``data`` update those sections; ``top`` adds top-level keys."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    return {
        "trainer": {"max_steps": 1, "accelerator": "cpu", "default_root_dir": str(root / "run"),
                    "enable_progress_bar": False, **(trainer or {})},
        "model": {"model": make_model_dir(root / "model"), **(model or {})},
        "data": {"dataset": write_prompts(root / "prompts.jsonl"), "reward_funcs": ["tests.helpers.length_reward"],
                 "num_generations": 4, "per_device_train_batch_size": 8, "generation": {"max_completion_length": 4},
                 **(data or {})},
        **top,
    }


def write_config(path: Path, config: dict) -> Path:
    """``config`` as a YAML file at ``path``."""
    import yaml

    Path(path).write_text(yaml.safe_dump(config))
    return Path(path)


def length_reward(completions, **kwargs):
    """Longer completions score higher: varied rewards, so advantages are non-zero."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(len(t)) for t in texts]


def count_a_reward(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [float(t.count("a")) for t in texts]


def length_reward_with_extras(completions, log_extra=None, log_metric=None, **kwargs):
    """``length_reward`` that also logs a table column and a scalar metric."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    if log_extra is not None:
        log_extra("num_chars", [len(t) for t in texts])
    if log_metric is not None:
        log_metric("my_metric", 3.0)
    return [float(len(t)) for t in texts]


def none_for_odd_answers(completions, answer, **kwargs):
    """Not applicable (None) to prompts with an odd answer: a multi-task reward."""
    return [None if int(a) % 2 else float(len(c)) for c, a in zip(completions, answer)]


def built(module):
    """``module`` with its models built (``configure_model``), as a Trainer would before fitting."""
    module.configure_model()
    return module


def count_forward_paths() -> dict[str, int]:
    """Counts, from now on in this process, the log-prob forwards that take the plain and the
    optimized path (``module/forward.py``): for the multi-process children, whose strategies must
    keep the optimized path."""
    import grpo_lightning.module.forward as forward_code

    paths = {"plain": 0, "optimized": 0}

    def counted(name, function):
        def call(*args, **kwargs):
            paths[name] += 1
            return function(*args, **kwargs)

        return call

    forward_code._plain_logprobs = counted("plain", forward_code._plain_logprobs)
    forward_code._optimized_logprobs = counted("optimized", forward_code._optimized_logprobs)
    return paths
