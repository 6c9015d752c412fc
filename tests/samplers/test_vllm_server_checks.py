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
