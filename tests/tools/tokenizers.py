"""The real Qwen2.5 / Qwen3 tokenizers of the shared assets (tool-aware chat templates)."""

from __future__ import annotations

from pathlib import Path

import pytest

FAMILIES = ("qwen2.5", "qwen3")
_CACHE: dict[str, object] = {}


def load_qwen(shared_assets: Path, family: str):
    """``AutoTokenizer`` of ``tokenizers/<family>``; skips (with the path) when it is absent."""
    path = shared_assets / "tokenizers" / family
    if not (path / "tokenizer_config.json").is_file():
        pytest.skip(f"the {family} tokenizer is not in the shared assets ({path})")
    if family not in _CACHE:
        from transformers import AutoTokenizer

        _CACHE[family] = AutoTokenizer.from_pretrained(str(path))
    return _CACHE[family]
