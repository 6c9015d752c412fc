"""Fixtures shared by the forward-path tests."""

from __future__ import annotations

import pytest

from grpo_lightning.module import forward as forward_module


@pytest.fixture
def no_plain_fallback(monkeypatch):
    """Fail if an optimized option silently takes the plain path."""

    def refuse(*args, **kwargs):
        raise AssertionError("the plain path ran")

    monkeypatch.setattr(forward_module, "_plain_logprobs", refuse)
