"""What the ours-vs-TRL benchmark runs on: the sizes, the models, the prompts and the reward.

Everything is built in code (nothing is downloaded). Each size's model is built once from a config,
saved with its tokenizer to a temporary folder, and both trainers load it from there.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Size:
    """One benchmark configuration: the model and the GRPO batch, identical for both trainers."""

    name: str
    description: str
    model: dict  # architecture settings for build_model()
    tokenizer: str  # "char" | "qwen2.5" (falls back to a built-in ~32K word vocabulary)
    num_generations: int
    prompts_per_step: int
    max_completion_length: int
    warmup_steps: int
    measured_steps: int
    repeats: int
    device: str = "cpu"

    @property
    def per_device_train_batch_size(self) -> int:
        # One optimizer step = one generation batch = one micro-batch (no accumulation), on both sides.
        return self.num_generations * self.prompts_per_step

    @property
    def max_steps(self) -> int:
        return self.warmup_steps + self.measured_steps


SIZES: dict[str, Size] = {
    "tiny": Size(
        name="tiny",
        description="tiny test model: build_tiny_causal_lm (Llama, hidden 32, 2 layers), char tokenizer",
        model=dict(architecture="llama", hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   tie_word_embeddings=False, max_position_embeddings=256),
        tokenizer="char",
        num_generations=8, prompts_per_step=4, max_completion_length=32,
        warmup_steps=3, measured_steps=10, repeats=3,
    ),
    "qwen-42m": Size(
        name="qwen-42m",
        description="Qwen2 architecture from a config: hidden 256, 4 layers, 4 heads (2 KV), MLP 1024, "
                    "tied embeddings, Qwen2.5 vocabulary",
        model=dict(architecture="qwen2", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                   intermediate_size=1024, tie_word_embeddings=True, max_position_embeddings=1024),
        tokenizer="qwen2.5",
        num_generations=8, prompts_per_step=2, max_completion_length=128,
        warmup_steps=1, measured_steps=3, repeats=2,
    ),
    # GPU only (--device cuda): the Qwen2.5-0.5B architecture from its config (random weights).
    "qwen0.5b": Size(
        name="qwen0.5b",
        description="Qwen2.5-0.5B architecture from a config (random init): hidden 896, 24 layers, 14 heads "
                    "(2 KV), MLP 4864, tied embeddings, Qwen2.5 vocabulary",
        model=dict(architecture="qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                   intermediate_size=4864, tie_word_embeddings=True, max_position_embeddings=32768,
                   rope_theta=1_000_000.0, rms_norm_eps=1e-6),
        tokenizer="qwen2.5",
        num_generations=8, prompts_per_step=8, max_completion_length=256,
        warmup_steps=1, measured_steps=3, repeats=1, device="cuda",
    ),
}


def shared_assets_dir() -> Path:
    """``$GRPO_SHARED_ASSETS``, default ``<repo>/../shared/assets`` (as tests/conftest.py)."""
    return Path(os.environ.get("GRPO_SHARED_ASSETS", REPO.parent / "shared" / "assets"))


# ----------------------------------------------------------------------------------- reward
def first_token_parity_reward(completions, completion_ids=None, **kwargs):
    """1.0 when the first completion token id is even: cheap, varied, independent of length."""
    return [float(bool(ids) and ids[0] % 2 == 0) for ids in completion_ids]


# ---------------------------------------------------------------------------------- prompts
_SUBJECTS = ["A farmer", "The library", "A baker", "Our team", "A small shop", "The school", "A train",
             "The museum", "A gardener", "The factory", "A student", "The harbour"]
_OBJECTS = ["apples", "books", "loaves", "tickets", "boxes", "chairs", "letters", "coins", "plants",
            "bottles", "marbles", "pencils"]
_TAILS = ["How many are there now?", "How many are left at the end of the day?",
          "If each one costs 3 dollars, what is the total cost?",
          "Explain the reasoning step by step before giving the final answer.",
          "Give the answer as a single number.",
          "Then half of them are given away to friends and neighbours. How many remain?"]


def text_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` short word problems of varying length (about 20-45 Qwen tokens)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        obj = rng.choice(_OBJECTS)
        out.append(f"Question {i}: {rng.choice(_SUBJECTS)} has {a} {obj} and gets {b} more {obj}. "
                   + " ".join(rng.sample(_TAILS, rng.randint(1, 2))) + " Answer:")
    return out


def arithmetic_prompts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{rng.randint(0, 99)}+{rng.randint(0, 99)}=" for _ in range(n)]


# ------------------------------------------------------------------------------- tokenizers
def build_word_tokenizer(vocab_size: int = 32_000):
    """Fallback for a machine without the shared Qwen tokenizer: a word-level fast tokenizer with
    ``vocab_size`` entries (the prompt words, the characters, then filler words), Qwen-style specials."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    words = sorted({w for p in text_prompts(512) for w in p.replace("?", " ?").replace(".", " .").replace(":", " :").split()})
    chars = [chr(c) for c in range(33, 127)]
    vocab_list = list(dict.fromkeys(specials + words + chars))
    vocab_list += [f"w{i}" for i in range(vocab_size - len(vocab_list))]
    backend = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(vocab_list)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)


def build_tokenizer(kind: str):
    """Returns ``(tokenizer, description)``."""
    if kind == "char":
        from grpo_lightning.utils.tiny_models import build_char_tokenizer

        return build_char_tokenizer(), "character tokenizer (grpo_lightning.utils.tiny_models)"
    qwen = shared_assets_dir() / "tokenizers" / "qwen2.5"
    if (qwen / "vocab.json").is_file():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(qwen))
        return tok, f"real Qwen2.5 tokenizer from {qwen} ({len(tok)} tokens)"
    tok = build_word_tokenizer()
    return tok, (f"built-in word-level tokenizer, {len(tok)} tokens (Qwen2.5 tokenizer not found at {qwen}; "
                 "set GRPO_SHARED_ASSETS)")


# ------------------------------------------------------------------------------------ model
def build_model(size: Size, tokenizer):
    """A randomly initialised fp32 causal LM for ``size`` (seeded), EOS/pad ids from ``tokenizer``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    m = dict(size.model)
    arch = m.pop("architecture")
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    hidden = m.pop("hidden_size")
    vocab = len(tokenizer)
    if arch == "qwen2":
        # Qwen2.5's padded embedding size, also with the built-in 32K tokenizer (no ../shared):
        # the model keeps its size and its 151K-wide LM head, the cost that matters here.
        vocab = max(vocab, 151_936)
    config = config_cls(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=m.pop("intermediate_size", 2 * hidden),
        num_hidden_layers=m.pop("num_layers"), num_attention_heads=m.pop("num_heads"),
        num_key_value_heads=m.pop("num_kv_heads"), pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **m,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_cls(config).float()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    return model


def add_eos_bias(model, tokenizer, prompts: list[str], mean_length: float) -> dict:
    """Make a random model end its completions after about ``mean_length`` tokens (geometric lengths).

    A random model spreads its probability almost uniformly over the vocabulary, so it would
    practically never sample EOS (1/151,665 per token with the Qwen vocabulary) and every completion
    would run to ``max_completion_length``. Qwen2/Llama have no LM-head bias, so the bias is put in
    the weights: one hidden channel ``d`` of the input embedding is set to a constant ``a`` for every
    token, which makes the final normalised hidden state's channel ``d`` large and positive at every
    position; the LM-head row of EOS gets ``+b`` on that channel. Every other token's logit moves by
    the same amount (``n_d * a``, or 0 for an untied head), so only EOS is favoured:
    ``logit_eos - logit_other ~= n_d * b``. ``b`` is set from the measured ``n_d`` so that
    P(EOS) ~= 1 / mean_length per token. Both trainers load the same modified weights.
    """
    import torch

    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    tied = head.data_ptr() == emb.data_ptr()
    d, eos, vocab = emb.shape[1] - 1, tokenizer.eos_token_id, emb.shape[0]
    batch = tokenizer(prompts[:8], return_tensors="pt", padding=True)
    real = batch.attention_mask.bool()
    with torch.no_grad():
        if not tied:
            head[:, d] = 0.0
        # A deep random model writes its own values into channel d: raise ``a`` until the channel
        # is consistently positive at every position (mean > 4 standard deviations).
        for a in (1.0, 4.0, 16.0, 64.0, 256.0):
            emb[:, d] = a
            hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask).last_hidden_state
            values = hidden[..., d][real]
            n_d, spread = float(values.mean()), float(values.std())
            if n_d > 0.5 and n_d > 4 * spread:
                break
        else:
            raise RuntimeError(f"could not make hidden channel {d} constant (mean {n_d:.3f}, std {spread:.3f})")
        p = 1.0 / mean_length
        target = math.log(p / (1 - p) * (vocab - 1))  # logit gap giving P(EOS) = p against a flat rest
        b = target / n_d
        head[eos, d] += b
    return {"channel": d, "a": a, "b": round(b, 4), "n_d": round(n_d, 3), "n_d_std": round(spread, 3),
            "target_logit_gap": round(target, 3), "target_mean_length": mean_length}


@dataclass
class Assets:
    size: str
    model_dir: str
    prompts_file: str
    tokenizer: str
    num_parameters: int
    matmul_parameters: int  # parameters used in matmuls (the input embedding of an untied model excluded)
    head_parameters: int  # the LM head (vocabulary projection), shared with the embedding when tied
    eos_bias: dict

    def to_dict(self) -> dict:
        return asdict(self)


def build_assets(size: Size, root: Path, num_prompts: int = 64) -> Assets:
    """Build ``size``'s model + tokenizer into ``root/model`` and its prompts into ``root/prompts.jsonl``."""
    started = time.perf_counter()
    tokenizer, tok_desc = build_tokenizer(size.tokenizer)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    prompts = arithmetic_prompts(num_prompts) if size.tokenizer == "char" else text_prompts(num_prompts)
    model = build_model(size, tokenizer)
    eos_bias = add_eos_bias(model, tokenizer, prompts, mean_length=size.max_completion_length / 2)
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompts_file = root / "prompts.jsonl"
    with open(prompts_file, "w") as f:
        for p in prompts:
            f.write(json.dumps({"prompt": p}) + "\n")
    n = sum(p.numel() for p in model.parameters())  # tied weights counted once
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    matmul = n - (emb.numel() if head.data_ptr() != emb.data_ptr() else 0)
    print(f"[assets] {size.name}: {n / 1e6:.2f}M parameters, {tok_desc}; EOS bias {eos_bias}; "
          f"built in {time.perf_counter() - started:.1f}s", flush=True)
    return Assets(size.name, str(model_dir), str(prompts_file), tok_desc, n, matmul, head.numel(), eos_bias)


# --------------------------------------------------------------------------- machine limits
def matmul_gflops(device: str = "cpu", n: int = 2048, dtype: str = "float32", repeats: int = 10) -> float:
    """Best-of-``repeats`` dense ``n x n`` matmul throughput in GFLOP/s (2 n^3 FLOPs per matmul)."""
    import torch

    dt = getattr(torch, dtype)
    a = torch.randn(n, n, device=device, dtype=dt)
    b = torch.randn(n, n, device=device, dtype=dt)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    best = math.inf
    inner = 1 if device == "cpu" else 20
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(inner):
            a @ b
        sync()
        best = min(best, (time.perf_counter() - t) / inner)
    return 2 * n**3 / best / 1e9


def main() -> None:
    """``python benchmarks/bench_assets.py SIZE ROOT OUT_JSON``: build one size's assets (a child
    process, so that the benchmark's parent process stays small)."""
    import sys

    size, root, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    sys.path.insert(0, str(REPO))
    root.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(build_assets(SIZES[size], root).to_dict()))


if __name__ == "__main__":
    main()
