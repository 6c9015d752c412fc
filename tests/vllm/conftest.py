"""Shared by the real-vLLM tests: the tiny model both the engine and the trainer load."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 with head_dim 32 (vLLM's CPU attention does not support 16) and its character
    tokenizer, saved to a temporary folder."""
    from grpo_lightning.utils.tiny_models import build_char_tokenizer, build_tiny_causal_lm
    from tests.helpers import ALPHABET

    path = tmp_path_factory.mktemp("qwen2_hd32")
    tokenizer = build_char_tokenizer(ALPHABET)
    model = build_tiny_causal_lm(len(tokenizer), architecture="qwen2", hidden_size=64, num_heads=2, num_kv_heads=1)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)
