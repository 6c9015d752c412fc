"""Reward models (spec §5.1/§5.2) on a tiny sequence classifier built in the test.

Scores are compared with one unpadded float64 forward per text, to the float32 rounding of a
forward through the classifier (``tests/numerics.py``, :func:`assert_scores`).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_lightning.rewards import RewardModel, RewardRunner, resolve_reward_funcs
from grpo_lightning.utils.tiny_models import build_char_tokenizer
from tests.module.test_forward_paths import reduction_size
from tests.numerics import assert_close_f32

PROMPTS = ["1+1=", "12+30=", "7*6=", "a long prompt: 99-1="]
COMPLETIONS = ["2", "42 I think", "42", "98, obviously, since 99-1 is 98"]


def build_classifier(tokenizer, seed: int = 0, **config_overrides):
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, num_labels=1,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        **config_overrides,
    )  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForSequenceClassification(config).float()


def manual_scores(model, tokenizer, texts: list[str]) -> list[float]:
    """One unpadded forward per text of a float64 copy: the reference for the padded, batched path."""
    model64 = copy.deepcopy(model).double()
    out = []
    with torch.no_grad():
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
            out.append(float(model64(input_ids=ids).logits[0, 0]))
    return out


def assert_scores(got, model, tokenizer, texts: list[str], msg="") -> None:
    """``got`` (float32 scores) equal :func:`manual_scores` to the float32 rounding of a forward
    through ``model`` for the longest text, relative to the largest score the head can give:
    ``‖w‖ · max|γ| · sqrt(hidden)`` (the final RMSNorm's output ``γ ⊙ n`` has ``‖n‖ = sqrt(hidden)``),
    plus 1 for the normed hidden states."""
    width = max(len(tokenizer(t, add_special_tokens=False).input_ids) for t in texts)
    head = model.score.weight.detach()
    gamma = float(model.model.norm.weight.detach().abs().max())
    scale = float(head.norm(dim=1).max()) * gamma * math.sqrt(head.shape[1]) + 1.0
    want = manual_scores(model, tokenizer, texts)
    assert_close_f32(got, want, reduction_size=reduction_size(model, width), scale=scale, msg=str(msg))


@pytest.fixture
def tok():
    return build_char_tokenizer()


def test_scores_equal_unpadded_forward_and_batching_invariance(tok) -> None:
    model = build_classifier(tok)
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    assert len(set(len(t) for t in texts)) > 1  # right padding is exercised
    for batch_size in (None, 1, 3, 4, 16):
        rm = RewardModel(model, tok, batch_size=batch_size)
        got = rm(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1]] * 4, extra=[0] * 4)
        assert_scores(got, model, tok, texts, msg=batch_size)
    assert rm.texts(PROMPTS, COMPLETIONS) == texts
    assert rm(prompts=[], completions=[]) == []
    with pytest.raises(ValueError, match="batch_size"):
        RewardModel(model, tok, batch_size=0)


def test_conversational_prompts_use_the_chat_template(tok) -> None:
    model = build_classifier(tok)
    prompts = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": p}] for p in PROMPTS]
    completions = [[{"role": "assistant", "content": c}] for c in COMPLETIONS]
    rm = RewardModel(model, tok, batch_size=2)
    texts = rm.texts(prompts, completions)
    assert texts == [tok.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
    assert texts[0] == "<|system|>be brief<|end|><|user|>1+1=<|end|><|assistant|>2<|end|></s>"
    assert_scores(rm(prompts, completions), model, tok, texts)
    # chat_template_kwargs reach the template: the runner fills them in for models without any.
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!{% endif %}"
    rm = RewardModel(model, tok)
    RewardRunner(resolve_reward_funcs([rm]), chat_template_kwargs={"shout": True})
    assert rm.chat_template_kwargs == {"shout": True}
    assert rm.texts(prompts[:1], completions[:1]) == ["be brief1+1=2!"]
    own = RewardModel(model, tok, chat_template_kwargs={"shout": False})
    RewardRunner(resolve_reward_funcs([own]), chat_template_kwargs={"shout": True})
    assert own.texts(prompts[:1], completions[:1]) == ["be brief1+1=2"]


def test_pad_token_defaults_to_eos_and_sets_model_config(tok) -> None:
    model = build_classifier(tok)
    model.config.pad_token_id = None
    rm = RewardModel(model, tok)
    assert model.config.pad_token_id == tok.pad_token_id == 0
    no_pad = build_char_tokenizer()
    no_pad.pad_token = None
    rm = RewardModel(model, no_pad)
    assert no_pad.pad_token == "</s>" and model.config.pad_token_id == no_pad.eos_token_id == 2
    # Padding with EOS: the texts themselves have no EOS, so the last real token is still pooled.
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    assert_scores(rm(PROMPTS, COMPLETIONS), model, no_pad, texts)


def test_eval_mode_and_no_grad(tok) -> None:
    model = build_classifier(tok, attention_dropout=0.5)  # train mode would make scores random
    model.train()
    with torch.no_grad():
        texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
        inputs = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        assert not torch.equal(model(**inputs).logits, model(**inputs).logits)
    rm = RewardModel(model, tok)
    assert not model.training
    model.train()  # someone switches it back: scoring still runs in eval mode
    first = rm(PROMPTS, COMPLETIONS)
    assert not model.training and rm(PROMPTS, COMPLETIONS) == first


def test_from_path_names_and_processing_classes(tok, tmp_path: Path) -> None:
    model = build_classifier(tok)
    folder = tmp_path / "tiny-rm"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    tok_folder = tmp_path / "tok"
    tok.save_pretrained(tok_folder)
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]

    (rf,) = resolve_reward_funcs([str(folder)])
    assert rf.name == "tiny-rm" and isinstance(rf.func, RewardModel) and not rf.is_async
    assert_scores(rf.func(PROMPTS, COMPLETIONS), model, tok, texts)
    assert rf.func.model.config.num_labels == 1 and not rf.func.model.training
    assert resolve_reward_funcs([str(folder) + "/"])[0].name == "tiny-rm"
    # A model object: name from config._name_or_path when it has one, else the class name.
    assert resolve_reward_funcs([rf.func.model])[0].name == "tiny-rm"
    assert resolve_reward_funcs([model], [tok])[0].name == "LlamaForSequenceClassification"
    # Tokenizer given as a path, one per func (None for the function), or one for all.
    funcs = resolve_reward_funcs(
        [model, str(folder), lambda completions, **kw: [0.0] * len(completions)],
        [str(tok_folder), None, "ignored for functions"],
        model_init_kwargs={"dtype": torch.float32},
    )
    assert [f.name for f in funcs] == ["LlamaForSequenceClassification", "tiny-rm", "<lambda>"]
    assert funcs[0].func.tokenizer is not tok and len(funcs[0].func.tokenizer) == len(tok)
    shared = resolve_reward_funcs([model, model], tok)
    assert shared[0].func.tokenizer is tok and shared[1].func.tokenizer is tok
    with pytest.raises(ValueError, match=r"data.reward_processing_classes has 1 entries but .* 2"):
        resolve_reward_funcs([model, model], [tok])
    with pytest.raises(ValueError, match="does not exist"):
        resolve_reward_funcs([str(tmp_path / "missing" / "rm")])
    with pytest.raises(ValueError, match="model_init_kwargs only apply"):
        RewardModel(model, tok, model_init_kwargs={"dtype": torch.float32})


def test_mixed_list_through_the_runner(tok) -> None:
    model = build_classifier(tok)

    def has_42(completions, **kwargs):
        return [1.0 if "42" in c else 0.0 for c in completions]

    async def length_reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    runner = RewardRunner(resolve_reward_funcs([has_42, model, length_reward], [None, tok, None]), [1.0, 0.5, 0.0])
    assert runner.names == ["has_42", "LlamaForSequenceClassification", "length_reward"]
    assert [type(m.model) for m in runner.reward_models] == [type(model)]
    out = runner.score(
        prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1]] * 4,
        columns={"answer": ["2", "42", "42", "98"]},
    )  # fmt: skip
    texts = [p + c for p, c in zip(PROMPTS, COMPLETIONS)]
    assert out.rewards[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0]
    assert_scores(out.rewards[:, 1], model, tok, texts)
    assert out.rewards[:, 2].tolist() == [float(len(c)) for c in COMPLETIONS]


def test_to_device_moves_reward_models_only(tok) -> None:
    model = build_classifier(tok)
    rm = RewardModel(model, tok)
    moved = []
    original_to = model.to
    model.to = lambda device: moved.append(device) or original_to(device)  # spy
    runner = RewardRunner(resolve_reward_funcs([rm, lambda completions, **kw: [0.0] * len(completions)]))
    assert runner.to("cpu") is runner and moved == ["cpu"]
    assert rm.device == torch.device("cpu")
    runner.to(torch.device("meta"))
    assert rm.device == torch.device("meta") and next(model.parameters()).is_meta


@pytest.mark.gpu
def test_scores_on_cuda_match_cpu(tok) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = build_classifier(tok)
    rm = RewardModel(model, tok, batch_size=2)
    cpu = rm(PROMPTS, COMPLETIONS)
    RewardRunner(resolve_reward_funcs([rm])).to("cuda:0")
    assert rm.device.type == "cuda"
    assert rm(PROMPTS, COMPLETIONS) == pytest.approx(cpu, abs=1e-4)


def test_plain_module_with_logits(tok) -> None:
    class Scorer(torch.nn.Module):
        """Not a PreTrainedModel: reward = number of non-pad tokens."""

        def __init__(self):
            super().__init__()
            self.dummy = torch.nn.Parameter(torch.zeros(()))

        def forward(self, input_ids, attention_mask=None, **kwargs):
            return SimpleNamespace(logits=attention_mask.sum(-1, keepdim=True).float() + self.dummy)

    (rf,) = resolve_reward_funcs([Scorer()], [tok])
    assert rf.name == "Scorer"
    assert rf.func(PROMPTS, COMPLETIONS) == [float(len(p + c)) for p, c in zip(PROMPTS, COMPLETIONS)]
    with pytest.raises(ValueError, match="has no tokenizer"):
        RewardModel(Scorer())


def test_reward_model_with_non_finite_logits_is_an_error(tok) -> None:
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.dummy = torch.nn.Parameter(torch.zeros(()))

        def forward(self, input_ids, attention_mask=None, **kwargs):
            logits = torch.zeros(input_ids.shape[0], 1) + self.dummy
            logits[1] = float("nan")
            return SimpleNamespace(logits=logits)

    runner = RewardRunner(resolve_reward_funcs([Broken()], [tok]))
    with pytest.raises(ValueError, match=r"reward model 'Broken' scored row 1 as nan.*dtype"):
        runner.score(prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1]] * 4)
    with pytest.raises(TypeError, match="path/Hub id or an nn.Module"):
        RewardModel(42)  # type: ignore[arg-type]
