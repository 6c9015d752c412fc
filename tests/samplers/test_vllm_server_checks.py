"""VLLMServerSampler's checks that need no vLLM: settings, an unreachable server, and completions
that do not belong to the prompt they are paired with (a scripted client stands in for the server;
tests/vllm/test_vllm_server.py runs the real one)."""

from __future__ import annotations

import time

import pytest

from tests.helpers import free_port

from grpo_lightning.samplers import sampler_class
from grpo_lightning.samplers.vllm_server import VLLMServerSampler
from grpo_lightning.samplers.vllm_server_client import VLLMServerError
from grpo_lightning.types import GenerationParams


class ScriptedClient:
    """Answers ``completions`` with scripted choices and records each request's fields."""

    def __init__(self, answer):
        self.answer, self.requests = answer, []

    def completions(self, prompts, **fields):
        self.requests.append((prompts, fields))
        return self.answer(prompts[0], fields)


class Handle:
    eos_token_ids = (2,)
    policy_version = 0


def _sampler(answer) -> VLLMServerSampler:
    sampler = VLLMServerSampler(weight_transfer_backend="gloo")
    sampler._handle, sampler.client, sampler._served_version = Handle(), ScriptedClient(answer), 0
    return sampler


def _choice(prompt, ids):
    return {"prompt_token_ids": list(prompt), "token_ids": list(ids), "logprobs": {"token_logprobs": [-1.0] * len(ids)}}


def test_registered_by_name_and_settings_checked():
    assert sampler_class("vllm_server") is VLLMServerSampler
    with pytest.raises(ValueError, match=r"weight_transfer_backend='tcp': use one of \['gloo', 'nccl'\]"):
        VLLMServerSampler(weight_transfer_backend="tcp")
    with pytest.raises(ValueError, match="max_concurrent_requests=0"):
        VLLMServerSampler(max_concurrent_requests=0)
    assert VLLMServerSampler(host="10.1.2.3", port=9000).base_url == "http://10.1.2.3:9000"
    assert VLLMServerSampler(base_url="http://h:1", host="x").base_url == "http://h:1"


def test_an_unreachable_server_fails_within_its_timeout_naming_the_fix():
    sampler = VLLMServerSampler(port=free_port(), host="127.0.0.1", server_timeout=1.0)
    start = time.perf_counter()
    with pytest.raises(VLLMServerError, match=r"was not up within 1 s \(server_timeout.*vllm serve MODEL"):
        sampler.bind(Handle())
    assert time.perf_counter() - start < 5


def test_each_prompt_is_its_own_request_with_its_own_seed_and_rollouts_keep_prompt_order():
    sampler = _sampler(lambda prompt, fields: [_choice(prompt, [7, prompt[0], 2, 9]) for _ in range(fields["n"])])
    prompts = [[5, 6], [8], [5, 6]]
    params = GenerationParams(max_completion_length=4, temperature=0.7, top_k=3, min_p=None)
    rollouts = sampler.generate(prompts, 2, params)
    assert [r.prompt_ids for r in rollouts] == [[5, 6]] * 2 + [[8]] * 2 + [[5, 6]] * 2
    assert all(r.completion_ids[-1] == 2 and r.ended_on_eos and len(r.sampling_logprobs) == 3 for r in rollouts)
    requests = sampler.client.requests
    assert sorted(map(tuple, (p[0] for p, _ in requests))) == sorted(map(tuple, prompts))
    assert len({fields["seed"] for _, fields in requests}) == 3  # identical prompts, different seeds
    fields = requests[0][1]
    assert (fields["n"], fields["temperature"], fields["top_k"], fields["min_p"], fields["max_tokens"]) == (2, 0.7, 3, 0.0, 4)
    assert fields["logprobs"] == 0 and fields["stop_token_ids"] == [2]


def test_completions_of_another_prompt_are_refused():
    sampler = _sampler(lambda prompt, fields: [_choice([1, 1], [3]) for _ in range(fields["n"])])
    with pytest.raises(VLLMServerError, match="generated for another prompt"):
        sampler.generate([[5, 6]], 2, GenerationParams(max_completion_length=4))
    short = _sampler(lambda prompt, fields: [_choice(prompt, [3])])
    with pytest.raises(VLLMServerError, match="returned 1 completions for prompt row 0, asked 2"):
        short.generate([[5, 6]], 2, GenerationParams(max_completion_length=4))


def test_prompts_longer_than_the_servers_context_are_an_error_before_any_request():
    sampler = _sampler(lambda prompt, fields: pytest.fail("no request may be sent"))
    sampler.max_model_len = 8
    with pytest.raises(ValueError, match=r"Prompt rows \[1\] .* max_model_len=8"):
        sampler.generate([[1, 2], [1, 2, 3, 4, 5]], 2, GenerationParams(max_completion_length=4))


def test_structured_outputs_and_generation_kwargs_reach_the_request():
    sampler = _sampler(lambda prompt, fields: [_choice(prompt, [2]) for _ in range(fields["n"])])
    sampler.structured_outputs_regex = r"\d+"
    sampler.generate([[4]], 1, GenerationParams(max_completion_length=4, generation_kwargs={"presence_penalty": 0.5}))
    fields = sampler.client.requests[0][1]
    assert fields["structured_outputs"] == {"regex": r"\d+"} and fields["presence_penalty"] == 0.5


class ImagePrompt(list):
    """A prompt's ids with images, as a dataset's ``MultimodalPrompt`` carries them."""

    def __init__(self, ids, images):
        super().__init__(ids)
        self.images = images


class ImageHandle(Handle):
    class tokenizer:
        class processor:
            image_token_id = 9


class ImageScriptedClient(ScriptedClient):
    """Text prompts through ``completions``; image prompts answered by ``answer_images``, which
    sees the ids sent and the images' URLs."""

    def __init__(self, answer, answer_images):
        super().__init__(answer)
        self.answer_images, self.image_requests = answer_images, []

    def generate_with_images(self, token_ids, image_urls, **fields):
        self.image_requests.append((list(token_ids), list(image_urls), fields))
        return self.answer_images(token_ids, image_urls, fields)


def _image_sampler(answer_images) -> VLLMServerSampler:
    sampler = _sampler(lambda prompt, fields: [_choice(prompt, [3, 2]) for _ in range(fields["n"])])
    sampler._handle = ImageHandle()
    sampler.client = ImageScriptedClient(sampler.client.answer, answer_images)
    return sampler


def _expanded(token_ids, image_tokens=3):
    """What a server's processor makes of ids with one placeholder (9) per image."""
    return [t for i in token_ids for t in ([9] * image_tokens if i == 9 else [i])]


def test_image_prompts_go_with_their_images_to_the_tokens_route():
    from tests.vlm.tiny_vlm import color_image

    def answer(token_ids, urls, fields):
        return {"prompt_token_ids": _expanded(token_ids), "choices": [
            {"token_ids": [4, 2, 5], "logprobs": {"content": [{"token_id": t, "logprob": -0.5} for t in (4, 2, 5)]}}
            for _ in range(fields["n"])]}

    sampler = _image_sampler(answer)
    image = color_image(0, (6, 4))
    prompts = [ImagePrompt([1, 9, 9, 9, 7], [image]), [1, 7]]  # the trainer's expansion: 3 image tokens
    rollouts = sampler.generate(prompts, 2, GenerationParams(max_completion_length=4))
    assert [r.prompt_ids for r in rollouts] == [[1, 9, 9, 9, 7]] * 2 + [[1, 7]] * 2
    assert rollouts[0].completion_ids == [4, 2] and rollouts[0].sampling_logprobs == [-0.5, -0.5]  # cut after EOS
    (sent, urls, fields), = sampler.client.image_requests
    assert sent == [1, 9, 7] and fields["n"] == 2 and fields["logprobs"] == 0  # one placeholder per image
    assert len(urls) == 1 and urls[0].startswith("data:image/png;base64,")
    import base64
    import io

    from PIL import Image

    decoded = Image.open(io.BytesIO(base64.b64decode(urls[0].split(",", 1)[1])))
    assert decoded.size == (6, 4) and list(decoded.getdata()) == list(image.getdata())  # lossless
    assert [p for p, _ in sampler.client.requests] == [[[1, 7]]]  # the text prompt: /v1/completions


def test_an_image_prompt_expanded_otherwise_by_the_server_is_refused():
    from tests.vlm.tiny_vlm import color_image

    sampler = _image_sampler(lambda ids, urls, fields: {"prompt_token_ids": _expanded(ids, 2), "choices": [
        {"token_ids": [2], "logprobs": {"content": [{"token_id": 2, "logprob": -1.0}]}}] * fields["n"]})
    with pytest.raises(VLLMServerError, match="expanded its image placeholders differently"):
        sampler.generate([ImagePrompt([1, 9, 9, 9, 7], [color_image(0)])], 1, GenerationParams(max_completion_length=4))
    missing = _image_sampler(lambda ids, urls, fields: {"prompt_token_ids": _expanded(ids), "choices": [
        {"token_ids": [4, 2], "logprobs": None}] * fields["n"]})
    with pytest.raises(VLLMServerError, match="returned 0 log-probs for 2 tokens"):
        missing.generate([ImagePrompt([1, 9, 9, 9, 7], [color_image(0)])], 1, GenerationParams(max_completion_length=4))


def test_a_server_without_the_tokens_route_is_named_with_the_flag(monkeypatch):
    from grpo_lightning.samplers.vllm_server_client import VLLMServerClient

    client = VLLMServerClient("http://127.0.0.1:1")
    client._model = "m"

    def forbidden(method, route, **kwargs):
        raise VLLMServerError(f"{method} http://127.0.0.1:1{route}: HTTP 403: Scale-out endpoints are disabled.")

    monkeypatch.setattr(client, "request", forbidden)
    with pytest.raises(VLLMServerError, match="restart it with --enable-scale-out"):
        client.generate_with_images([1, 9], ["data:image/png;base64,"], n=1)
