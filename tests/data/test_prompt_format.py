"""Prompt tokenization and completion decoding, TRL semantics."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo_lightning.data.prompt_format import decode_completions, tokenize_prompt
from grpo_lightning.utils.tiny_models import build_char_tokenizer

CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def qwen(shared_assets: Path):
    path = shared_assets / "tokenizers" / "qwen2.5"
    if not path.exists():
        pytest.skip(f"{path} not present")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _char_ids(tok, text: str) -> list[int]:
    return [tok.convert_tokens_to_ids(c) for c in text]


def test_string_prompt_uses_plain_call(tok) -> None:
    assert tokenize_prompt("12+3=", tok) == tok("12+3=")["input_ids"]
    assert tokenize_prompt("ab", tok) == _char_ids(tok, "ab")


def test_conversational_prompt_adds_generation_prompt(tok) -> None:
    ids = tokenize_prompt(CHAT, tok)
    text = tok.decode(ids)
    assert text == "<|user|>hi<|end|><|assistant|>"
    assert ids == tok.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)


def test_final_assistant_message_is_continued(tok) -> None:
    prompt = CHAT + [{"role": "assistant", "content": "ok"}]
    assert tok.decode(tokenize_prompt(prompt, tok)) == "<|user|>hi<|end|><|assistant|>ok"


def test_chat_template_kwargs_are_forwarded(tok) -> None:
    ids = tokenize_prompt(CHAT, tok, {"add_generation_prompt": False})
    assert tok.decode(ids) == "<|user|>hi<|end|>"


def test_no_chat_template_is_a_clear_error() -> None:
    plain = build_char_tokenizer(chat_template=False)
    with pytest.raises(ValueError, match="no chat template"):
        tokenize_prompt(CHAT, plain)
    assert tokenize_prompt("hi", plain) == plain("hi")["input_ids"]


def test_bad_prompt_type(tok) -> None:
    with pytest.raises(ValueError, match="neither a string nor"):
        tokenize_prompt([1, 2, 3], tok)


def test_decode_completions(tok) -> None:
    ids = [tok("ab")["input_ids"] + [tok.eos_token_id], tok("c")["input_ids"]]
    assert decode_completions(ids, tok, conversational=False) == ["ab", "c"]
    assert decode_completions(ids, tok, conversational=True) == [
        [{"role": "assistant", "content": "ab"}],
        [{"role": "assistant", "content": "c"}],
    ]


def test_qwen25_conversational_prompt(qwen) -> None:
    ids = tokenize_prompt(CHAT, qwen)
    assert all(isinstance(i, int) for i in ids)
    text = qwen.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are Qwen")
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert ids[-3:] == [151644, 77091, 198]  # <|im_start|> assistant \n


def test_qwen25_string_prompt_and_decode(qwen) -> None:
    assert tokenize_prompt("Hello, world!", qwen) == [9707, 11, 1879, 0]
    completion = [9707, 11, 1879, 0, qwen.convert_tokens_to_ids("<|im_end|>")]
    assert decode_completions([completion], qwen, conversational=True) == [
        [{"role": "assistant", "content": "Hello, world!"}]
    ]


def test_qwen3_enable_thinking_kwarg(shared_assets: Path) -> None:
    path = shared_assets / "tokenizers" / "qwen3"
    if not path.exists():
        pytest.skip(f"{path} not present")
    from transformers import AutoTokenizer

    qwen3 = AutoTokenizer.from_pretrained(str(path))
    thinking = qwen3.decode(tokenize_prompt(CHAT, qwen3))
    no_thinking = qwen3.decode(tokenize_prompt(CHAT, qwen3, {"enable_thinking": False}))
    assert thinking.endswith("<|im_start|>assistant\n")
    assert no_thinking.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
