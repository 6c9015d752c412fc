"""Under DeepSpeed ZeRO-3 the no-grad log-prob passes (old policy, reference model) fetch the LM
head's weight once per pass, not once per chunk.

ZeRO-3 is simulated the way it partitions: between calls the head's ``weight.data`` is an empty
tensor, and hooks around the head module's call put the whole weight in place and take it away
after. A read of the weight outside one call of the module fails; each call is one fetch (an
all-gather of the whole weight on a real run).
"""

from __future__ import annotations

import pytest
import torch

from grpo_lightning.module import forward as forward_module
from grpo_lightning.module.forward import ForwardOptions, completion_logprobs
from tests.module.test_forward_paths import TEMPERATURE, make_batch, tiny

CHUNK = 3  # tokens through the head at once: the batch's 18 completion tokens take 6 chunks
PATHS = {
    "chunked": ForwardOptions(chunked_lm_head=True, padding_free=False, lm_head_chunk_tokens=CHUNK),
    "chunked+packed": ForwardOptions(lm_head_chunk_tokens=CHUNK),
    # 39 prompt and completion tokens in budgets of 24: two groups, so two forwards
    "chunked+packed, token budget": ForwardOptions(lm_head_chunk_tokens=CHUNK, logprob_token_budget=24),
}


class PartitionedHead:
    """``head``'s weight held outside it, in place only during a call of the module (counted)."""

    def __init__(self, head: torch.nn.Linear) -> None:
        self.head, self.whole, self.fetches = head, head.weight.data, 0
        head.weight.data = torch.empty(0)
        head.register_forward_pre_hook(self._fetch)
        head.register_forward_hook(self._release)

    def _fetch(self, module, inputs) -> None:
        self.fetches += 1
        module.weight.data = self.whole

    def _release(self, module, inputs, output) -> None:
        module.weight.data = torch.empty(0)


def zero3(monkeypatch, model) -> PartitionedHead:
    head = model.get_output_embeddings()
    monkeypatch.setattr(forward_module, "zero3_parameters", lambda module: [module.weight] if module is head else [])
    return PartitionedHead(head)


def count_passes(monkeypatch) -> dict[str, int]:
    """Counts the optimized forwards (one per token-budget group)."""
    passes, optimized = {"count": 0}, forward_module._optimized_logprobs

    def counted(*args, **kwargs):
        passes["count"] += 1
        return optimized(*args, **kwargs)

    monkeypatch.setattr(forward_module, "_optimized_logprobs", counted)
    return passes


@pytest.mark.parametrize("path", PATHS)
def test_no_grad_pass_fetches_the_head_once_per_forward(monkeypatch, path):
    model, options = tiny(), PATHS[path]
    prompt_ids, prompt_mask, completion_ids, completion_mask, _ = make_batch()
    batch = (prompt_ids, prompt_mask, completion_ids, completion_mask, TEMPERATURE)
    with torch.no_grad():
        expected = completion_logprobs(model, *batch, options=options)
        partitioned, passes = zero3(monkeypatch, model), count_passes(monkeypatch)
        logps, entropies = completion_logprobs(model, *batch, options=options)
    assert partitioned.fetches == passes["count"] == (1 if options.logprob_token_budget is None else 2)
    assert completion_mask.sum() > CHUNK * passes["count"], "the test needs a pass of several chunks"
    torch.testing.assert_close(logps, expected[0], rtol=0, atol=0)  # the same matmuls
    torch.testing.assert_close(entropies, expected[1], rtol=0, atol=0)


def test_a_head_with_its_own_forward_is_called_per_chunk(monkeypatch):
    """A head that is not a plain ``nn.Linear`` may do anything in its forward: it is called (and
    so fetched) per chunk, as before."""

    class ScaledHead(torch.nn.Linear):
        def forward(self, hidden):
            return super().forward(hidden) * 0.5

    model = tiny()
    plain = model.lm_head
    model.lm_head = ScaledHead(plain.in_features, plain.out_features, bias=False)
    model.lm_head.weight.data = plain.weight.data.clone()
    prompt_ids, prompt_mask, completion_ids, completion_mask, _ = make_batch()
    batch = (prompt_ids, prompt_mask, completion_ids, completion_mask, TEMPERATURE)
    options = PATHS["chunked+packed"]
    with torch.no_grad():
        expected = completion_logprobs(model, *batch, options=options)
        partitioned = zero3(monkeypatch, model)
        logps, _ = completion_logprobs(model, *batch, options=options)
    chunks = -(-int(completion_mask.sum()) // CHUNK)
    assert partitioned.fetches == chunks
    torch.testing.assert_close(logps, expected[0], rtol=0, atol=0)
