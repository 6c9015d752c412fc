"""A lean decode loop over the live policy: ``hf_generate``'s sampling, with cheap exact sampling,
finished rows dropped from the batch and the sampled tokens' log-probs (docs/fast_generation.md)."""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch

from grpo_lightning.samplers.base import Sampler
from grpo_lightning.samplers.generation_checks import check_hf_generation
from grpo_lightning.samplers.hf_common import build_generation_config, completion_rollout, generation_mode, image_inputs
from grpo_lightning.types import GenerationParams, PromptInput, Rollout
from grpo_lightning.utils.image_positions import computes_own_positions, prefill_positions
from grpo_lightning.utils.weight_casts import reused_weight_casts

#: transformers logits processors that are pure functions of ``(input_ids, scores)``: applied
#: unchanged to the rows still running, they process each row exactly as ``generate`` does.
ROW_WISE_PROCESSORS = frozenset({
    "TemperatureLogitsWarper", "TopKLogitsWarper", "TopPLogitsWarper", "MinPLogitsWarper",
    "TypicalLogitsWarper", "EpsilonLogitsWarper", "EtaLogitsWarper", "RepetitionPenaltyLogitsProcessor",
    "NoRepeatNGramLogitsProcessor", "MinLengthLogitsProcessor", "MinNewTokensLengthLogitsProcessor",
    "SuppressTokensLogitsProcessor", "NoBadWordsLogitsProcessor", "SequenceBiasLogitsProcessor",
    "InfNanRemoveLogitsProcessor", "LogitNormalization",
})
#: ``GenerationConfig`` fields that change the search itself rather than the per-token
#: distribution, with the value this loop implements.
SEARCH_SETTINGS = {"do_sample": True, "num_beams": 1, "num_return_sequences": 1, "stop_strings": None,
                   "assistant_model": None, "prompt_lookup_num_tokens": None, "use_cache": True}
BLOCK = 1024  # vocabulary block of the two-level inverse-CDF draw


class FastGenerateSampler(Sampler):
    """Samples from the policy being trained with a hand-written decode loop, the distribution of
    ``hf_generate`` at a fraction of its per-token cost on CPU.

    Same sampling as ``hf_generate``: the ``GenerationConfig`` of ``data.generation`` (merged with
    the model's generation config as ``generate`` does), its logits processors applied unchanged
    (temperature, top-k/top-p/min-p, repetition penalty, ...), stopping on every EOS id, a
    completion cut after the first. What differs is how each step is spent: one prefill with
    ``logits_to_keep=1``, then per step one forward of the still-running rows (rows that ended are
    removed from the batch and from the KV cache) and an exact draw from ``softmax(scores)`` by a
    two-level inverse CDF (vocabulary blocks, then a token inside the block; cumulative sums in
    float64) that needs one uniform number per row instead of ``multinomial``'s one exponential
    number per vocabulary entry. Settings whose processors are not row-wise, or that change the
    search (beams, ``stop_strings``, ``do_sample=False``, ...), raise a ``ValueError`` naming them.

    **Log-probs** (``Rollout.sampling_logprobs``, float32): ``log_softmax`` of the processed scores
    at the sampled token, i.e. of ``logits / T`` after truncation (and any penalty), as vLLM's
    processed log-probs. Without truncation they are the trainer's ``log_softmax(logits / T)`` up to
    float32 rounding.

    **Randomness.** Each call takes one draw from the global generator (``torch.randint``) and seeds
    a private generator with it, so the training process's RNG stream moves by the same amount
    whatever the completion lengths; the same global seed gives the same completions. The draws
    differ from ``generate``'s (which consumes one exponential number per vocabulary entry and row
    at every step): same distribution, other samples.

    **Precision.** The parameters are never cast: the forward runs under the training precision
    context (``bf16-mixed`` autocast), scores are taken in float32 (as ``generate`` does). Autocast's
    weight-cast cache is on for the request (``cache_weight_casts``): each trainable weight is cast
    to 16 bits once per request, not once per decode step.
    Gradient checkpointing is paused and the model is in eval mode while generating; every
    module's training flag is restored afterwards. Weights are gathered under sharding
    (``handle.generation_context()``).

    **Images** (vision-language models, prompts with ``model_inputs``): the prefill takes the
    rows' pixel inputs, collated as for ``hf_generate``; the decode steps feed text tokens only.
    Models that place the images in 3-D positions themselves (Qwen-VL's M-RoPE) get no position
    ids for the prefill, and each row's decode positions continue from the largest position the
    model gave its prompt (recorded from its language model's call), on every axis.

    **LM head on CPU.** For a float32 ``nn.Linear`` head outside autocast, the decode steps apply
    the head with oneDNN on a copy of its weight made at each call (MKL's ``sgemm`` is 2-3x
    slower for a few rows against a 152K-token vocabulary); the copy is checked once per call
    against the model's own logits and dropped if they differ by more than float32 rounding.

    Args:
        max_batch_rows: generate at most this many sequences at once, to bound memory; ``None``
            generates the whole request at once.
        onednn_head: apply a float32 LM head with oneDNN on CPU (above); ``False`` always calls the
            model's own head.
        cache_weight_casts: keep the 16-bit casts of the weights for the whole request under
            ``*-mixed`` precision; ``False`` casts them at every decode step, saving that copy's
            memory (2 bytes per trainable parameter).
    """

    name = "fast_generate"
    provides_logprobs = True
    supports_images = True

    def __init__(self, max_batch_rows: int | None = None, onednn_head: bool = True, cache_weight_casts: bool = True):
        super().__init__()
        if max_batch_rows is not None and max_batch_rows < 1:
            raise ValueError(f"max_batch_rows={max_batch_rows}: use a positive number or None.")
        self.max_batch_rows = max_batch_rows
        self.onednn_head = onednn_head
        self.cache_weight_casts = cache_weight_casts

    def check_generation(self, params: GenerationParams) -> None:
        check_hf_generation(params, "data.sampler: fast_generate")

    def generate(
        self, prompts: Sequence[PromptInput], num_generations: int, params: GenerationParams
    ) -> list[Rollout]:
        handle = self.handle
        model = handle.policy
        rows = [p for p in prompts for _ in range(num_generations)]  # prompt-major (with their image inputs)
        if not rows:
            return []
        config = self._generation_config(params)
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
        generator = torch.Generator(device=handle.device).manual_seed(seed)
        step = self.max_batch_rows or len(rows)
        stop, version = set(handle.eos_token_ids), handle.policy_version
        rollouts: list[Rollout] = []
        with handle.generation_context(), generation_mode(model), _eval_mode(model), handle.precision_context(), \
                reused_weight_casts(handle.device, self.cache_weight_casts):
            for start in range(0, len(rows), step):
                chunk = rows[start : start + step]
                ids, logprobs = self._decode(model, chunk, config, generator)
                rollouts.extend(completion_rollout(list(r), i, stop, version, lp) for r, i, lp in zip(chunk, ids, logprobs))
        return rollouts

    def _generation_config(self, params: GenerationParams) -> Any:
        """``generate``'s prepared config: ours, then the model's generation config for unset fields."""
        model = self.handle.policy
        config, _ = model._prepare_generation_config(build_generation_config(self.handle, params))
        for field, value in SEARCH_SETTINGS.items():
            if getattr(config, field, value) != value:
                raise ValueError(
                    f"FastGenerateSampler samples one sequence per row with a KV cache; it cannot apply "
                    f"{field}={getattr(config, field)!r} (from data.generation or the model's generation config). "
                    "Drop the setting or use data.sampler: hf_generate."
                )
        return config

    def _processors(self, model: Any, config: Any, input_ids: torch.Tensor) -> Any:
        model._prepare_special_tokens(config, kwargs_has_attention_mask=True, device=input_ids.device)
        processors = model._get_logits_processor(
            generation_config=config, input_ids_seq_length=input_ids.shape[1], encoder_input_ids=input_ids,
            device=input_ids.device, model_kwargs={},
        )
        refused = [type(p).__name__ for p in processors if type(p).__name__ not in ROW_WISE_PROCESSORS]
        if refused:
            raise ValueError(
                f"data.generation asks for {refused}, which FastGenerateSampler cannot apply row by row (it "
                "applies temperature, top_k, top_p, min_p, repetition_penalty, min_new_tokens, bad/suppressed "
                "tokens, ...). Drop the setting or use data.sampler: hf_generate."
            )
        return processors

    def _decode(
        self, model: Any, prompts: Sequence[PromptInput], config: Any, generator: torch.Generator
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Completion ids (cut after the first EOS at the latest) and their log-probs for ``prompts``."""
        from transformers import DynamicCache

        device = self.handle.device
        rows = [list(p) for p in prompts]
        pad = config.pad_token_id if config.pad_token_id is not None else 0
        width, n = max(len(r) for r in rows), len(rows)
        input_ids = torch.full((n, width), pad, dtype=torch.long)  # (R, Tp) left-padded
        attention_mask = torch.zeros((n, width), dtype=torch.long)
        for i, ids in enumerate(rows):
            input_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention_mask[i, width - len(ids) :] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        processors = self._processors(model, config, input_ids)
        eos = config._eos_token_tensor
        eos = torch.tensor([], dtype=torch.long, device=device) if eos is None else eos.to(device).reshape(-1)
        max_new = config.max_new_tokens
        positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 0)  # as generate's
        images = {k: v.to(device) for k, v in image_inputs(prompts, width).items()}  # the prefill's pixel inputs
        own_positions = bool(images) and computes_own_positions(model)  # M-RoPE: (3, r, 1) positions
        cache = DynamicCache(config=model.config)
        cache_kwarg = cache_keyword(model)
        tokens = torch.full((n, max_new), pad, dtype=torch.long, device=device)  # (R, T) sampled ids
        logps = torch.zeros((n, max_new), dtype=torch.float32, device=device)
        lengths = torch.full((n,), max_new, dtype=torch.long)
        live = torch.arange(n, device=device)  # rows still running, as indices into the request
        draw = ExactDraw()
        step_ids, step_mask, step_pos = input_ids, attention_mask, positions
        # (the oneDNN head runs the decoder alone: text models only)
        head = OneDNNHead.for_model(model) if self.onednn_head and not images else None
        decoder = model.get_decoder() if head is not None else None
        for t in range(max_new):
            inputs = dict(input_ids=step_ids, attention_mask=step_mask, position_ids=step_pos, use_cache=True,
                          **{cache_kwarg: cache})
            if t == 0 and images:
                inputs.update(images)
            if t == 0 and own_positions:
                del inputs["position_ids"]  # the model places the images itself
                with prefill_positions(model) as recorded:
                    logits, hidden = _model_logits(model, decoder, inputs)
                step_pos = recorded.last_positions(attention_mask)  # (3, R, 1): each row's last position
            elif t == 0 or head is None:
                logits, hidden = _model_logits(model, decoder, inputs)
                if head is not None and not head.reproduces(hidden, logits):
                    head = None  # the model's logits are not its LM head's output (soft-capping, scaling, ...)
                if t == 0 and cache.get_seq_length() == 0:
                    raise RuntimeError(
                        f"FastGenerateSampler: the model left the KV cache passed as {cache_kwarg}= empty, so later "
                        "tokens would be sampled without their context. Use data.sampler: hf_generate for this model."
                    )
            else:
                logits = head(decoder(**inputs, return_dict=True).last_hidden_state[:, -1])
            scores = processors(input_ids, logits.float())  # (r, V)
            next_ids, next_logps = draw(scores, generator)
            tokens[live, t], logps[live, t] = next_ids, next_logps
            input_ids = torch.cat([input_ids, next_ids[:, None]], dim=-1)
            ended = torch.isin(next_ids, eos)
            if ended.any():
                lengths[live[ended].cpu()] = t + 1
                keep = (~ended).nonzero()[:, 0]
                if keep.numel() == 0:
                    break
                live, input_ids, next_ids = live[keep], input_ids[keep], next_ids[keep]
                attention_mask, step_pos = attention_mask[keep], step_pos.index_select(-2, keep)  # rows: dim -2
                cache.batch_select_indices(keep)
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(live), 1))], dim=-1)
            step_ids, step_mask, step_pos = next_ids[:, None], attention_mask, step_pos[..., -1:] + 1
        tokens, logps = tokens.cpu().tolist(), logps.cpu().tolist()
        keep_lengths = lengths.tolist()
        return ([row[:k] for row, k in zip(tokens, keep_lengths)], [row[:k] for row, k in zip(logps, keep_lengths)])


def cache_keyword(model: Any) -> str:
    """The keyword under which ``model``'s forward takes its KV cache: ``cache`` from transformers
    5.24, ``past_key_values`` before (a PEFT wrapper is looked through to its base model)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    parameters = inspect.signature(type(base).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _model_logits(model: Any, decoder: Any, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's own last-position logits ``(r, V)``, and its decoder's last hidden state
    ``(r, H)`` when ``decoder`` is given (to check a replacement head against)."""
    seen: list[Any] = []
    hook = None if decoder is None else decoder.register_forward_hook(lambda mod, args, out: seen.append(out))
    try:
        out = model(**inputs, logits_to_keep=1, return_dict=True)
    finally:
        if hook is not None:
            hook.remove()
    hidden = None
    if seen:
        last = seen[-1]
        hidden = (last.last_hidden_state if hasattr(last, "last_hidden_state") else last[0])[:, -1]
    return out.logits[:, -1], hidden


class OneDNNHead:
    """A float32 ``nn.Linear`` LM head applied by oneDNN, on a copy of its weight (``(V, H)``)."""

    def __init__(self, linear: torch.nn.Linear):
        from torch.utils.mkldnn import MkldnnLinear

        self.weight = linear.weight.detach()
        self.linear = MkldnnLinear(linear, torch.float32)

    @classmethod
    def for_model(cls, model: Any) -> OneDNNHead | None:
        """The head of ``model`` when it qualifies: a plain float32 ``nn.Linear`` on CPU, no
        autocast, oneDNN available, a decoder to take the hidden states from."""
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        if type(head) is not torch.nn.Linear or head.weight.device.type != "cpu" or head.weight.dtype != torch.float32:
            return None
        if torch.is_autocast_enabled("cpu") or not torch.backends.mkldnn.is_available():
            return None
        if getattr(model, "get_decoder", lambda: None)() is None:
            return None
        return cls(head)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden.contiguous())  # (r, H) -> (r, V)

    def reproduces(self, hidden: torch.Tensor | None, logits: torch.Tensor) -> bool:
        """Whether this head gives ``logits`` from ``hidden`` up to float32 rounding on both sides:
        a dot product of ``H`` terms rounds by about ``sqrt(H) eps |h| |w|`` (tests/numerics.py)."""
        if hidden is None or hidden.dtype != torch.float32 or logits.shape[-1] != self.weight.shape[0]:
            return False
        ours = self(hidden)
        scale = float(hidden.norm(dim=-1).max()) * float(self.weight.norm(dim=-1).max())
        tol = 16 * hidden.shape[-1] ** 0.5 * torch.finfo(torch.float32).eps * scale
        return bool((ours - logits.float()).abs().max() <= tol)


class ExactDraw:
    """One token per row from ``softmax(scores)`` and its log-prob, with one uniform number per row.

    Two-level inverse CDF: ``e = exp(scores - max)`` is written into a buffer padded to whole
    blocks of ``BLOCK`` tokens (the padding stays 0); the block is chosen by the float64 cumulative
    sum of the block sums, the token by the float64 cumulative sum inside that block. A uniform
    ``u`` in ``(0, 1]`` selects the first entry whose cumulative sum reaches ``u`` times the total,
    which always has a positive probability (a truncated token, ``-inf``, or the padding is never
    drawn). Each token's probability is its ``e`` over the total, up to the float32 rounding of
    ``e`` and of the block sums (relative ``~1e-7`` and ``~sqrt(BLOCK) 1e-7``), the rounding with
    which ``multinomial`` over float32 ``softmax`` probabilities draws as well.
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None  # (rows, blocks * BLOCK), sized by the first call
        self.vocab = self.blocks = 0

    def __call__(self, scores: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        r, v = scores.shape
        blocks = -(-v // BLOCK)
        if self.buffer is None or v != self.vocab or r > self.buffer.shape[0] or self.buffer.device != scores.device:
            self.vocab, self.blocks = v, blocks  # the padding past ``v`` must stay 0
            self.buffer = torch.zeros((r, blocks * BLOCK), dtype=torch.float32, device=scores.device)
        top = scores.max(-1, keepdim=True).values  # (r, 1)
        if not bool(torch.isfinite(top).all()):
            raise RuntimeError("the policy's scores hold NaN or +inf (or only -inf): nothing to sample from.")
        e = self.buffer[:r]  # (r, nb * BLOCK), contiguous
        torch.sub(scores, top, out=e[:, :v]).exp_()
        block_e = e.view(r, self.blocks, BLOCK)  # (r, nb, BLOCK)
        sums = block_e.sum(-1).double()  # (r, nb)
        cum = sums.cumsum(-1)
        total = cum[:, -1:]  # (r, 1)
        u = 1.0 - torch.rand((r, 1), dtype=torch.float64, generator=generator, device=scores.device)  # (0, 1]
        target = u * total
        block = torch.searchsorted(cum, target).clamp_(max=self.blocks - 1)  # (r, 1)
        before = torch.where(block > 0, cum.gather(1, (block - 1).clamp_(min=0)), 0.0)
        frac = (target - before) / (cum.gather(1, block) - before)  # (0, 1]
        rows = torch.arange(r, device=scores.device)
        inner = block_e[rows, block[:, 0]].to(torch.float64).cumsum(-1)  # (r, BLOCK)
        offset = torch.searchsorted(inner, frac * inner[:, -1:]).clamp_(max=BLOCK - 1)  # (r, 1)
        ids = (block * BLOCK + offset)[:, 0]
        logps = (scores.gather(1, ids[:, None]) - top)[:, 0].double() - total[:, 0].log()
        return ids, logps.float()


class _eval_mode:
    """Eval mode while generating; every module's training flag restored afterwards."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __enter__(self) -> None:
        self.modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()

    def __exit__(self, *exc: Any) -> None:
        for module, training in self.modes:
            module.training = training
