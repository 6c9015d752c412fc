"""Tiny offline models and tokenizers, built in code: for tests, the demo and config smoke runs.

Nothing here touches a hub. ``build_char_tokenizer`` gives a real ``PreTrainedTokenizerFast``
(one token per character, pad/bos/eos, a ChatML-like chat template), and ``build_tiny_causal_lm``
a randomly initialised Llama or Qwen2 of a few thousand parameters.
"""

from __future__ import annotations

import string
from typing import Literal

import torch

DEFAULT_ALPHABET = string.ascii_letters + string.digits + string.punctuation + " \n"

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>")

# Renders [{"role", "content"}, ...] as <|role|>content<|end|>; the generation prompt opens an
# assistant turn, and an assistant turn ends with <|end|></s> so that EOS terminates replies.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{% if message['role'] == 'assistant' %}</s>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, *, chat_template: bool = True):
    """A character-level ``PreTrainedTokenizerFast``: one id per character of ``alphabet``.

    Special tokens: ``<pad>`` 0, ``<s>`` 1, ``</s>`` 2 (EOS), ``<unk>`` 3, then the chat role
    markers, then the alphabet. No BOS is added when encoding, so ``tok("12+3=")`` is exactly one
    id per character.

    >>> tok = build_char_tokenizer("0123456789+=")
    >>> tok("12+3=").input_ids == [tok.convert_tokens_to_ids(c) for c in "12+3="]
    True
    >>> tok.decode(tok("7+1=8").input_ids)
    '7+1=8'
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, UNK, *ROLE_TOKENS]
    chars = list(dict.fromkeys(alphabet))  # unique, order kept
    vocab = {token: i for i, token in enumerate(specials + [c for c in chars if c not in specials])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        clean_up_tokenization_spaces=False,
    )
    if chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_causal_lm(
    vocab_size: int,
    *,
    architecture: Literal["llama", "qwen2"] = "llama",
    hidden_size: int = 32,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 256,
    tie_word_embeddings: bool = False,
    pad_token_id: int = 0,
    bos_token_id: int = 1,
    eos_token_id: int = 2,
    seed: int = 0,
):
    """A randomly initialised causal LM (``LlamaForCausalLM`` or ``Qwen2ForCausalLM``), fp32.

    >>> model = build_tiny_causal_lm(40)
    >>> model.config.vocab_size, sum(p.numel() for p in model.parameters()) < 50_000
    (40, True)
    """
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[architecture]
    config = config_cls(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    return model.float()
