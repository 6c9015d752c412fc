"""Fixtures of the vision-language tests: a tiny Qwen2-VL and its processor, built offline."""

from __future__ import annotations

import pytest

from tests.vlm.tiny_vlm import qwen2_vl_model, qwen_asset_processor


@pytest.fixture(scope="session")
def qwen_processor(shared_assets):
    return qwen_asset_processor(shared_assets)


@pytest.fixture
def qwen_model(qwen_processor):
    return qwen2_vl_model(qwen_processor.tokenizer).eval()


@pytest.fixture(scope="session")
def idefics3_processor(shared_assets):
    from tests.vlm.tiny_vlm import idefics3_processor as build

    folder = shared_assets / "tokenizers" / "qwen2.5"
    if not folder.is_dir():
        pytest.skip(f"the Qwen2.5 tokenizer asset is missing at {folder}")
    try:
        return build(folder)
    except ImportError as error:  # transformers before its PIL image processors needs torchvision here
        pytest.skip(f"the Idefics3 image processor of this transformers needs torchvision: {error}")
