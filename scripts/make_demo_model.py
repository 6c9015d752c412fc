"""Build the quickstart demo asset: a tiny warm-started arithmetic model and its prompt sets.

Writes
    examples/arithmetic/model/       tokenizer + LlamaForCausalLM (safetensors, fp32, ~1 MB)
    examples/arithmetic/train.jsonl  GRPO prompts  {"prompt": "23+41=", "answer": "64"}
    examples/arithmetic/test.jsonl   held-out prompts (never seen in the warm start)

Task: ``"a+b="`` with two-digit operands (10-99), so every prompt is exactly 6 characters = 6
tokens (no prompt padding anywhere), and the completion is the 2-3 digits of the sum then ``</s>``.

Warm start: supervised training on a *noisy* mix. Each time a training example is drawn, its
target is the true sum with probability ``--p-correct`` and otherwise the sum shifted by a small
delta (+-1, +-2, +-10). The model learns the arithmetic (greedy decoding is mostly right) but
hedges, so sampling at temperature 1.0 is right only about ``p-correct`` of the time. GRPO with an
exact-match reward then has something visible to do: sharpen the policy onto the right answer.

Deterministic (seeded); about 2 minutes on 2 idle CPU cores::

    python scripts/make_demo_model.py
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo_lightning.utils.tiny_models import (  # noqa: E402
    build_char_tokenizer,
    build_tiny_causal_lm,
)

ALPHABET = "0123456789+-*=() \n"
LO, HI = 10, 99  # operand range (inclusive): every prompt is "ab+cd=", 6 tokens
DELTAS = (-10, -2, -1, 1, 2, 10)  # wrong-answer offsets of the noisy targets
MAX_ANSWER_DIGITS = 3  # sums are 20..198, noisy targets 10..208


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", type=Path, default=ROOT / "examples" / "arithmetic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=96)
    p.add_argument("--num-layers", type=int, default=3)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--steps", type=int, default=2500, help="warm-start optimizer steps")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.33, help="cosine floor / --lr")
    p.add_argument("--p-correct", type=float, default=0.3, help="share of clean targets")
    p.add_argument("--num-test", type=int, default=500, help="held-out pairs")
    p.add_argument("--num-train-prompts", type=int, default=4000, help="rows of train.jsonl")
    return p.parse_args()


def all_pairs() -> list[tuple[int, int]]:
    return [(a, b) for a in range(LO, HI + 1) for b in range(LO, HI + 1)]


def noisy_target(a: int, b: int, rng: random.Random, p_correct: float) -> int:
    s = a + b
    if rng.random() < p_correct:
        return s
    return s + rng.choice(DELTAS)  # s >= 20, so never negative


def encode_batch(tok, pairs, targets) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids ``[B, 6 + 3 + 1]`` right-padded, and the loss mask of the completion tokens."""
    width = 6 + MAX_ANSWER_DIGITS + 1
    vocab = tok.get_vocab()  # one id per character (verify_reload checks this equals tok(text))
    ids = torch.full((len(pairs), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(pairs), width), dtype=torch.bool)
    for i, ((a, b), t) in enumerate(zip(pairs, targets)):
        prompt = [vocab[c] for c in f"{a}+{b}="]
        completion = [vocab[c] for c in str(t)] + [tok.eos_token_id]
        row = prompt + completion
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, len(prompt) : len(row)] = True
    return ids, mask


def warm_start(model, tok, train_pairs, args) -> None:
    rng = random.Random(args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = 100
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup)
        * max(
            args.min_lr_ratio,
            0.5 * (1 + torch.cos(torch.tensor(torch.pi * s / args.steps)).item()),
        ),
    )
    model.train()
    t0 = time.time()
    for step in range(1, args.steps + 1):
        pairs = [rng.choice(train_pairs) for _ in range(args.batch_size)]
        targets = [noisy_target(a, b, rng, args.p_correct) for a, b in pairs]
        ids, mask = encode_batch(tok, pairs, targets)
        logits = model(input_ids=ids).logits  # right padding only: causal mask suffices
        # position t predicts token t+1
        loss = F.cross_entropy(logits[:, :-1][mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 250 == 0 or step == 1:
            print(f"  step {step:5d}  loss {loss.item():.4f}  lr {sched.get_last_lr()[0]:.2e}  "
                  f"{time.time() - t0:6.1f}s", flush=True)
    model.eval()


@torch.no_grad()
def accuracy(model, tok, pairs, *, do_sample: bool, seed: int = 0, batch_size: int = 500) -> float:
    """Exact-match accuracy of ``model.generate`` (greedy, or sampled at temperature 1.0)."""
    torch.manual_seed(seed)
    correct = 0
    for i in range(0, len(pairs), batch_size):
        chunk = pairs[i : i + batch_size]
        enc = tok([f"{a}+{b}=" for a, b in chunk], return_tensors="pt")  # all 6 tokens: no padding
        gen_kwargs = dict(do_sample=False)
        if do_sample:
            gen_kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        out = model.generate(
            **enc,
            max_new_tokens=MAX_ANSWER_DIGITS + 2,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            **gen_kwargs,
        )
        texts = tok.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
        correct += sum(t.strip() == str(a + b) for t, (a, b) in zip(texts, chunk))
    return correct / len(pairs)


def write_jsonl(path: Path, pairs) -> None:
    with path.open("w") as f:
        for a, b in pairs:
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")


def verify_reload(model, tok, folder: Path) -> None:
    """Reload with the Auto classes and check ids, specials, chat template and logits."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok2 = AutoTokenizer.from_pretrained(folder)
    model2 = AutoModelForCausalLM.from_pretrained(folder)
    model2.eval()
    assert tok2.get_vocab() == tok.get_vocab(), "vocabulary changed on reload"
    assert tok2.chat_template == tok.chat_template and tok2.chat_template, "chat template lost"
    for name in ("pad", "bos", "eos", "unk"):
        assert getattr(tok2, f"{name}_token") == getattr(tok, f"{name}_token"), name
        assert getattr(tok2, f"{name}_token_id") == getattr(tok, f"{name}_token_id"), name
    assert (tok2.pad_token_id, tok2.bos_token_id, tok2.eos_token_id) == (0, 1, 2)
    text = "23+41=64"
    per_char = [tok.convert_tokens_to_ids(c) for c in text]
    assert tok2(text).input_ids == tok(text).input_ids == per_char
    assert tok2.decode(tok2(text).input_ids) == text
    msgs = [{"role": "user", "content": "23+41="}, {"role": "assistant", "content": "64"}]
    rendered = tok.apply_chat_template(msgs, tokenize=False)
    assert tok2.apply_chat_template(msgs, tokenize=False) == rendered, rendered
    assert rendered == "<|user|>23+41=<|end|><|assistant|>64<|end|></s>", rendered
    assert model2.config.pad_token_id == 0 and model2.config.eos_token_id == 2
    assert model2.generation_config.eos_token_id in (2, [2])
    assert model2.generation_config.pad_token_id == 0
    assert next(model2.parameters()).dtype == torch.float32
    ids = torch.tensor([tok("23+41=64").input_ids, tok("99+99=19").input_ids])
    with torch.no_grad():
        torch.testing.assert_close(model2(ids).logits, model(ids).logits, rtol=0, atol=0)
    files = sorted(p.name for p in folder.iterdir())
    assert "model.safetensors" in files, files
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size <= 5 * 2**20, f"{size} bytes > 5 MB"
    print(f"reload check ok: {files}, {size / 2**20:.2f} MiB")


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    t_start = time.time()

    tok = build_char_tokenizer(ALPHABET)
    model = build_tiny_causal_lm(
        len(tok),
        architecture="llama",
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        seed=args.seed,
    )
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: llama hidden={args.hidden_size} layers={args.num_layers} vocab={len(tok)} "
          f"params={n_params:,}")

    pairs = all_pairs()
    random.Random(args.seed).shuffle(pairs)
    test_pairs = pairs[: args.num_test]
    train_pairs = pairs[args.num_test :]  # the warm start sees these only (with noisy targets)
    grpo_pairs = train_pairs[: args.num_train_prompts]

    print(f"warm start: {args.steps} steps x {args.batch_size}, lr {args.lr}, "
          f"p_correct {args.p_correct}, {len(train_pairs)} train pairs")
    warm_start(model, tok, train_pairs, args)

    out = args.out
    model_dir = out / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    for stale in model_dir.iterdir():
        stale.unlink()
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    write_jsonl(out / "train.jsonl", grpo_pairs)
    write_jsonl(out / "test.jsonl", test_pairs)
    print(f"wrote {model_dir}, {out / 'train.jsonl'} ({len(grpo_pairs)} rows), "
          f"{out / 'test.jsonl'} ({len(test_pairs)} rows)")
    verify_reload(model, tok, model_dir)

    eval_train = grpo_pairs[:500]
    print("warm-start accuracy (exact match):")
    for name, ps in (("train.jsonl[:500]", eval_train), ("test.jsonl", test_pairs)):
        g = accuracy(model, tok, ps, do_sample=False)
        s = accuracy(model, tok, ps, do_sample=True, seed=args.seed)
        print(f"  {name:18s} greedy {g:.3f}   sampled@T=1.0 {s:.3f}")
    print(f"done in {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
