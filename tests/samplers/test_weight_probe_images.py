"""The weight probe of a vision-language policy also checks the vision tower: an engine whose
vision weights differ passes the token sequence (it reaches the language model only) and fails
the image probe (a tiny Qwen2-VL; the engine is a copy of the policy, its forward the engine's)."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_lightning.module import GRPOModule
from grpo_lightning.samplers.weight_probe import WeightProbe, WeightSyncError
from tests.helpers import built
from tests.vlm.tiny_vlm import qwen2_vl_model, qwen_asset_processor


@pytest.fixture(scope="module")
def qwen_processor(shared_assets):
    return qwen_asset_processor(shared_assets)


@pytest.fixture
def handle(qwen_processor):
    return built(GRPOModule(qwen2_vl_model(qwen_processor.tokenizer).double().eval(), tokenizer=qwen_processor,
                            save_final_model=False))


def _engine(model):
    """Text and image log-prob functions of an 'engine' serving ``model``."""
    probe_ids = []

    def text(ids):
        probe_ids.append(ids)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1].double()
        return logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()

    def image(ids, images, probe):
        assert images == [probe.image.image] and ids == probe.image.token_ids
        return probe.image.trainer_logprobs(model, torch.device("cpu"))[0].tolist()

    return text, image


def test_the_probe_of_a_vlm_has_an_image_whose_tokens_see_the_vision_tower(handle, qwen_processor):
    probe = WeightProbe.for_handle(handle)
    assert probe.image is not None
    ids = probe.image.token_ids
    assert ids.count(qwen_processor.image_token_id) > 0 and "pixel_values" in probe.image.model_inputs
    assert WeightProbe.for_handle(handle).image.token_ids == ids  # the same every time
    text, image = _engine(copy.deepcopy(handle.policy))
    report = probe.verify(handle, text, engine_image_logprobs=lambda i, imgs: image(i, imgs, probe))
    assert report.ok  # the same weights: within the rounding of the trainer's float32 logits
    assert probe.bound(handle, 1.0) > 2 * 8 * 5.6 * torch.finfo(torch.float32).eps  # the LM's hidden size (32)


def test_an_engine_without_the_pushed_vision_tower_fails_the_image_probe_only(handle):
    probe = WeightProbe.for_handle(handle)
    engine = copy.deepcopy(handle.policy)
    with torch.no_grad():
        for name, param in engine.named_parameters():
            if "visual" in name:
                param.mul_(1.5)
    text, image = _engine(engine)
    probe.verify(handle, text)  # the token sequence cannot tell
    with pytest.raises(WeightSyncError, match=r"not served: the engine's log-prob of image-probe token \d+"):
        probe.verify(handle, text, version=3, engine_image_logprobs=lambda i, imgs: image(i, imgs, probe))


def test_a_text_policy_has_no_image_probe():
    from grpo_lightning.utils.tiny_models import build_char_tokenizer, build_tiny_causal_lm
    from tests.helpers import ALPHABET

    tokenizer = build_char_tokenizer(ALPHABET)
    module = built(GRPOModule(build_tiny_causal_lm(len(tokenizer)), tokenizer=tokenizer, save_final_model=False))
    assert WeightProbe.for_handle(module).image is None


def test_a_sampler_encodes_its_probe_image_once(handle, monkeypatch):
    """The vLLM samplers verify every push with the same probe: the image is encoded at the first."""
    from types import SimpleNamespace

    from grpo_lightning.samplers import weight_probe

    encodings = []
    encode = weight_probe.ImageProbe.for_processor

    def counted(processor):
        encodings.append(processor)
        return encode(processor)

    monkeypatch.setattr(weight_probe.ImageProbe, "for_processor", staticmethod(counted))
    sampler = SimpleNamespace(engine_dtype=torch.float32, probe_tolerance=None)
    first = WeightProbe.of_sampler(sampler, handle)
    assert WeightProbe.of_sampler(sampler, handle) is first and len(encodings) == 1
    sampler.engine_dtype = torch.bfloat16  # another engine dtype: another tolerance, a new probe
    assert WeightProbe.of_sampler(sampler, handle).engine_dtype == torch.bfloat16 and len(encodings) == 2


def test_the_probe_runs_the_policy_without_dropout_and_draws_no_random_numbers():
    """With dropout in the model, a probe in train mode would read noisy log-probs (a push judged
    corrupted) and move training's random streams; it runs in eval mode, modes restored after."""
    from types import SimpleNamespace

    from grpo_lightning.utils.tiny_models import build_tiny_causal_lm

    model = build_tiny_causal_lm(40, seed=1)
    model.config.attention_dropout = 0.9
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.9
    model.train()
    model.model.embed_tokens.eval()  # a submodule's own mode survives the probe
    handle = SimpleNamespace(policy=model, device=torch.device("cpu"))
    probe = WeightProbe(list(range(3, 19)), torch.float32)
    stream = torch.get_rng_state()
    first, second = probe.trainer_logprobs(handle)[0], probe.trainer_logprobs(handle)[0]
    assert torch.equal(first, second) and torch.equal(torch.get_rng_state(), stream)
    assert model.training and not model.model.embed_tokens.training and model.model.layers[0].training
