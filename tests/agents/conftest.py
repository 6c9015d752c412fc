import pytest

from tests.tools.tokenizers import FAMILIES, load_qwen


@pytest.fixture(params=FAMILIES)
def qwen(request, shared_assets):
    """Each real Qwen tokenizer in turn: ``(family, tokenizer)``."""
    return request.param, load_qwen(shared_assets, request.param)
