"""Peak memory per device of a GRPO run, estimated from the settings before the first step.

Everything here is arithmetic on explicit inputs (a model's shape, parameter counts, the
precision, optimizer, sharding, batch and forward settings): no model, no Lightning. The
``MemoryPlanner`` callback (``grpo_lightning/callbacks/memory_plan.py``) reads these inputs off a
run; ``benchmarks/memory_plan_check.py`` checks the total against measured peaks
(``docs/memory.md``).

Notation: ``P`` parameters, ``L`` decoder layers, ``h`` hidden size, ``i`` MLP width, ``V``
vocabulary, ``q = n_heads·head_dim``, ``kv = n_kv_heads·head_dim``, ``B`` rows of a micro-batch,
``Tp``/``Tc`` prompt/completion tokens per row, ``T = Tp + Tc``, ``W`` world size.

A run's memory has a persistent part (weights, reference, optimizer states, often gradients) and,
at any moment, the transients of one phase: generation, the no-grad log-prob passes, the training
forward+backward, the optimizer step. The peak is the largest phase plus what is resident under it.
Gradients are alive from a backward to the end of its optimizer step, through every micro-batch
of an accumulation window, and they are allocated during the backward while the saved activations
are still mostly alive. The module drops them when the step ends (``module/step_gradients.py``),
so when every generation batch starts an accumulation window (``accumulate`` divides
``steps_per_generation × num_iterations``, the default) the generation and its log-prob passes run
without them: the gradients are then a ``backward to step`` line, counted in the training and
optimizer-step phases only. Otherwise (or under DeepSpeed, whose engine keeps its gradient
buffers) they are persistent. Each phase is a worst case: every completion runs to
``max_completion_length`` and every prompt is as long as ``prompt_length``.

Layer L0: pure python.
The inputs, :class:`ModelShape` and :class:`MemorySettings`, are in ``memory_inputs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from grpo_lightning.utils.memory_inputs import MemorySettings, ModelShape

GiB = 1024**3
#: Optimizer state bytes per trainable parameter per unit of parameter bytes (torch's AdamW
#: allocates ``exp_avg``/``exp_avg_sq`` with ``zeros_like(param)``: 2 × the parameter's bytes;
#: SGD's momentum buffer: 1 ×). 8-bit AdamW is absolute: 2 states × 1 byte (bitsandbytes).
_STATE_COPIES = {"adamw": 2.0, "sgd_momentum": 1.0, "sgd": 0.0, "none": 0.0}
_SHARDS = {  # what a strategy divides by W: weights (and reference), gradients, optimizer states
    "single": (False, False, False), "ddp": (False, False, False),
    "fsdp": (True, True, True), "fsdp2": (True, True, True),
    "deepspeed_stage_1": (False, False, True), "deepspeed_stage_2": (False, True, True),
    "deepspeed_stage_3": (True, True, True),
}  # fmt: skip


@dataclass(frozen=True)
class MemoryLine:
    """One component: its size on one device, the phase it belongs to and how it was sized."""

    name: str
    bytes: int
    phase: Literal["persistent", "backward to step", "generation", "logprobs", "training", "optimizer step"]
    formula: str


@dataclass(frozen=True)
class MemoryPlan:
    """The estimate: a line per component; ``total`` = the largest of the phases' resident bytes
    (:meth:`resident`) plus their transients."""

    lines: tuple[MemoryLine, ...]
    settings: MemorySettings
    shape: ModelShape
    notes: tuple[str, ...] = field(default_factory=tuple)

    def phase_bytes(self, phase: str) -> int:
        return sum(line.bytes for line in self.lines if line.phase == phase)

    @property
    def persistent(self) -> int:
        return self.phase_bytes("persistent")

    def resident(self, phase: str) -> int:
        """Bytes alive under ``phase``'s transients: the persistent lines, and the ``backward to
        step`` lines (gradients dropped before the next generation) in training and the step."""
        during_step = phase in ("training", "optimizer step")
        return self.persistent + (self.phase_bytes("backward to step") if during_step else 0)

    def phase_total(self, phase: str) -> int:
        """The device's bytes at ``phase``'s peak: what is resident plus its transients."""
        return self.resident(phase) + self.phase_bytes(phase)

    @property
    def peak_phase(self) -> str:
        phases = ("training", "generation", "logprobs", "optimizer step")
        return max(phases, key=self.phase_total)

    @property
    def total(self) -> int:
        return self.phase_total(self.peak_phase)

    def line(self, name: str) -> MemoryLine:
        return next(line for line in self.lines if line.name == name)


def layer_activation_bytes(shape: ModelShape, s: MemorySettings, seq: int) -> float:
    """Bytes autograd saves for backward per token in one decoder layer (no checkpointing).

    Counted from the Llama/Qwen2 layer's ops (transformers 5): residual-dtype tensors ``6h`` (the
    layer input, RMSNorm's normalised and scaled outputs, twice, and the residual after
    attention); matmul-dtype tensors ``5q`` (q, rotate_half(q), q after RoPE, the attention
    output and its re-laid-out copy), ``4kv`` (k, rotate_half(k), k after RoPE, v), ``2q`` more
    when ``n_kv < n_heads`` (transformers repeats k/v for sdpa whenever a mask is given, which
    GRPO's padded or packed batches always have) and ``4i`` (gate, up, silu(gate), their
    product); under autocast ``2h`` for the 16-bit copies of the norm outputs the matmuls take.
    ``eager`` attention adds the ``(n_heads, T)`` attention probabilities per token, twice (the
    softmax in fp32 and its cast); fused kernels keep a log-sum-exp per head only.
    """
    h, i, q, kv = shape.hidden_size, shape.intermediate_size, shape.q, shape.kv
    compute = 5 * q + 4 * kv + (2 * q if shape.num_kv_heads < shape.num_heads else 0) + 4 * i
    if s.mixed:
        compute += 2 * h
    per_token = 6 * h * s.residual_bytes + compute * s.compute_bytes + shape.num_heads * 4
    if s.attention == "eager":
        per_token += 2 * shape.num_heads * seq * s.compute_bytes
    return per_token


def _tokens_per_pass(rows: int, seq: int, budget: int | None) -> int:
    """Tokens one forward holds: ``rows × T`` worst case (all rows full: padding-free packing
    saves nothing then), or as many whole rows as the token budget holds (parts never split a
    row; a row longer than the budget is a part of its own)."""
    if budget is None:
        return rows * seq
    return min(rows, max(1, budget // seq)) * seq


def _head_transient(shape: ModelShape, s: MemorySettings, completion_tokens: int, rows: int, grad: bool) -> tuple[int, str]:
    """The LM head's vocabulary-sized buffers.

    Chunked head (``algo/chunked_logprobs.py``): 2 fp32 ``(chunk, V)`` buffers — in forward the
    chunk's logits and ``exp(z − max)``, in backward the recomputed logits and ``∂/∂logits`` built
    from them (a third, ``coef``, when the entropy bonus needs its gradient) — plus, in backward,
    the ``(V, h)`` fp32 product ``gradᵀ·h`` added into the head's gradient per chunk. Independent
    of the batch. Plain path (TRL's, ``algo/logprobs.py``): under grad, 4 fp32 ``(B, Tc, V)``
    tensors at the start of backward — the fp32 copy log-softmax saved, and the gradient as it
    passes log-sum-exp, the temperature division and the slice out of the model's
    ``(B, Tc+1, V)`` logits (slice backward materialises a full-size zero tensor), each a new
    tensor; without grad the model's logits (matmul dtype) and one fp32 8-row chunk.
    """
    V = shape.vocab_size
    if s.chunked_lm_head:
        chunk = min(s.lm_head_chunk_tokens, completion_tokens)
        copies = 3 if (grad and s.entropy_grad) else 2
        product = V * shape.hidden_size * 4 if grad else 0
        return copies * chunk * V * 4 + product, f"{copies} x {chunk} tokens x {V} vocab x 4 B" + (" + V x h x 4 B" if grad else "")
    if grad:
        return completion_tokens * V * 16, f"4 x {completion_tokens} tokens x {V} vocab x 4 B"
    kept = min(rows, 8) * (completion_tokens // max(rows, 1)) * V * 4
    return completion_tokens * V * s.compute_bytes + kept, f"{completion_tokens} x {V} x {s.compute_bytes} B + an fp32 8-row chunk"


def estimate_memory(shape: ModelShape, s: MemorySettings) -> MemoryPlan:
    """Peak bytes per device of ``shape`` trained with ``s`` (see the module docstring)."""
    L, h, V = shape.num_layers, shape.hidden_size, shape.vocab_size
    W = max(s.world_size, 1)
    shard_w, shard_g, shard_o = (_SHARDS[s.strategy] if W > 1 or s.strategy != "single" else (False,) * 3)
    div = lambda sharded: W if sharded else 1  # noqa: E731
    P_all = s.trainable_parameters + s.frozen_parameters
    wb, cb = s.weight_bytes, s.compute_bytes
    deepspeed = s.strategy.startswith("deepspeed")
    lines: list[MemoryLine] = []
    notes: list[str] = []
    add = lambda *a: lines.append(MemoryLine(*a))  # noqa: E731

    # ---- persistent
    # DeepSpeed under *-mixed keeps 16-bit module weights and fp32 master weights in the optimizer.
    module_bytes = 2 if (deepspeed and s.mixed) else wb
    add("policy weights", P_all * module_bytes // div(shard_w), "persistent",
        f"{P_all:,} params x {module_bytes} B" + (f" / {W}" if shard_w else ""))
    if s.reference:
        add("reference model", P_all * module_bytes // div(shard_w), "persistent",
            f"{P_all:,} params x {module_bytes} B (frozen copy, beta != 0)" + (f" / {W}" if shard_w else ""))
    T_ = s.trainable_parameters
    # DeepSpeed's engine owns its gradient buffers (ZeRO's flat partitions) and keeps them.
    gradient_phase = "persistent" if (s.gradients_at_generation or deepspeed) else "backward to step"
    add("gradients", T_ * module_bytes // div(shard_g), gradient_phase,
        f"{T_:,} trainable x {module_bytes} B" + (f" / {W}" if shard_g else ""))
    if s.optimizer == "adamw_8bit":
        state, formula = T_ * 2, f"{T_:,} x 2 states x 1 B (8-bit)"
    else:
        copies = _STATE_COPIES[s.optimizer]
        state_bytes = 4 if deepspeed else wb
        state, formula = int(T_ * copies * state_bytes), f"{T_:,} x {copies:g} states x {state_bytes} B"
    add("optimizer states", state // div(shard_o), "persistent", formula + (f" / {W}" if shard_o else ""))
    if deepspeed and s.mixed:
        add("fp32 master weights", T_ * 4 // div(shard_o), "persistent", f"{T_:,} x 4 B (DeepSpeed 16-bit training)")
    if s.strategy == "ddp":
        # DDP's reducer copies gradients into flat buckets (gradient_as_bucket_view=False, the default).
        add("DDP gradient buckets", T_ * wb, "persistent", f"{T_:,} x {wb} B (flat all-reduce buckets)")
    if s.sampler == "vllm_colocate":
        engine = _vllm_bytes(shape, s)
        if engine is None:
            notes.append("vLLM share unknown: give the device memory (CPU: vLLM takes a fraction of RAM).")
        else:
            add("vLLM engine (weights + KV cache)", engine, "generation" if s.vllm_sleep_mode else "persistent",
                _vllm_formula(s))

    # ---- training forward + backward
    seq = s.prompt_length + s.completion_length
    tokens = _tokens_per_pass(s.rows, seq, s.train_token_budget)
    rows_pass = max(1, tokens // seq)
    c_tokens = rows_pass * s.completion_length
    per_layer = layer_activation_bytes(shape, s, seq)
    if s.gradient_checkpointing:
        act = tokens * (L * h * s.residual_bytes + per_layer)
        act_formula = f"{tokens:,} tokens x ({L} layers x {h} x {s.residual_bytes} B + one layer {per_layer:,.0f} B)"
    else:
        act = tokens * L * per_layer
        act_formula = f"{tokens:,} tokens x {L} layers x {per_layer:,.0f} B"
    # After the layers: the final norm (two residual-dtype tensors) and the completion hidden
    # states the head keeps for backward.
    act += tokens * 2 * h * s.residual_bytes + c_tokens * h * s.residual_bytes
    add("activations (training)", int(act), "training", act_formula)
    head, head_formula = _head_transient(shape, s, c_tokens, rows_pass, grad=True)
    add("LM head logits (training)", int(head), "training", head_formula)
    if shape.tie_word_embeddings:
        # A tied matrix gets two (V, h) gradients, the head's and the embedding's: autograd keeps
        # the first as .grad and adds the second, which exists in full for a moment.
        add("tied embedding gradient", V * h * module_bytes, "training", f"{V} x {h} x {module_bytes} B")
    # sdpa/eager take a boolean (rows, 1, T, T) mask (padded or packed rows), built once per
    # forward and saved for backward by every layer's attention.
    add("attention mask", rows_pass * seq * seq, "training", f"{rows_pass} x {seq}^2 x 1 B")
    if s.mixed:
        # Every linear saves the 16-bit cast of its weight for backward (Lightning's autocast does
        # not cache casts; the saved copies add up to the same), so they live through the pass.
        add("autocast 16-bit weight copies", T_ * 2 // div(shard_w), "training", f"{T_:,} x 2 B")
    if shard_w:
        # FSDP/ZeRO-3 gather one block's full weights at a time, and prefetch the next.
        add("gathered shards (training)", 2 * shape.layer_parameters * cb, "training",
            f"2 blocks x {shape.layer_parameters:,} x {cb} B")

    # ---- no-grad log-prob passes (old / reference)
    if s.logprob_rows:
        lp_tokens = _tokens_per_pass(s.logprob_rows, seq, s.logprob_token_budget)
        lp_rows = max(1, lp_tokens // seq)
        # Without grad only a few layer tensors live at once: the residual, the norm output and the
        # MLP's gate, up, activation and product.
        live = lp_tokens * ((3 * h) * s.residual_bytes + (4 * shape.intermediate_size + shape.q + 2 * shape.kv) * cb)
        add("activations (log-prob pass)", live, "logprobs", f"{lp_tokens:,} tokens x one layer's live tensors")
        lp_head, lp_formula = _head_transient(shape, s, lp_rows * s.completion_length, lp_rows, grad=False)
        add("LM head logits (log-prob pass)", int(lp_head), "logprobs", lp_formula)

    # ---- generation
    if s.sampler == "hf":
        g = s.generation_rows or s.rows
        kv = g * seq * L * 2 * shape.kv * cb
        add("KV cache (generation)", kv, "generation", f"{g} rows x {seq} tokens x {L} layers x 2 x {shape.kv} x {cb} B")
        # Prefill of the prompts (no grad): one layer's live tensors; each decode step's logits
        # and the sampler's fp32 copies of them (scores, processed scores, probabilities).
        prefill = g * s.prompt_length * ((3 * h) * s.residual_bytes + (4 * shape.intermediate_size + shape.q) * cb)
        add("prefill + sampling buffers", prefill + 3 * g * V * 4, "generation", f"{g} x {s.prompt_length} prompt tokens; 3 x {g} x {V} x 4 B")
    if s.sampler == "hf" and s.generation_weight_casts and s.mixed and not deepspeed:
        # Autocast's weight-cast cache, on for the request (utils/weight_casts.py): one 16-bit copy
        # of every trainable weight, whole even under sharding (the request gathers the weights).
        add("autocast 16-bit weight copies (generation)", T_ * 2, "generation",
            f"{T_:,} trainable x 2 B (sampler cache_weight_casts)")
    if shard_w and s.sampler == "hf":
        add("gathered weights (generation)", P_all * module_bytes * (W - 1) // W, "generation",
            f"the other {W - 1}/{W} of {P_all:,} x {module_bytes} B (generation_context)")

    # ---- optimizer step
    if s.optimizer_foreach and s.optimizer in ("adamw", "sgd_momentum"):
        add("optimizer step temporaries", T_ * wb // div(shard_o), "optimizer step", f"{T_:,} x {wb} B (foreach sqrt/denominator)")
    return MemoryPlan(tuple(lines), s, shape, tuple(notes))


def _vllm_bytes(shape: ModelShape, s: MemorySettings) -> int | None:
    """The colocated engine: ``kv_cache_memory_gib`` + its bf16 weights when given, else the
    ``gpu_memory_utilization`` fraction of the device, which vLLM takes whole at start."""
    if s.vllm_kv_cache_bytes is not None:
        return s.vllm_kv_cache_bytes + shape.num_parameters * 2
    if s.device_bytes is None:
        return None
    return int(s.vllm_gpu_memory_utilization * s.device_bytes)


def _vllm_formula(s: MemorySettings) -> str:
    if s.vllm_kv_cache_bytes is not None:
        return f"kv_cache_memory_gib {s.vllm_kv_cache_bytes / GiB:.2f} GiB + params x 2 B"
    return f"gpu_memory_utilization {s.vllm_gpu_memory_utilization:g} x device memory"
