"""A tool returning images to a vision-language policy (tiny Qwen2-VL and Qwen3-VL, processors built
offline): the tool turn's ids come from the processor with the image tokens expanded, the row's image
inputs grow (prompt image, then tool image), the next turn's generation receives them, and the
training forward on the final sequence equals a plain model call on the full ids and pixels."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from grpo_lightning.agents import AgentSampler
from grpo_lightning.data.collate import pad_sequences
from grpo_lightning.data.multimodal import encode_multimodal_prompt, row_inputs_of
from grpo_lightning.module.forward import completion_logprobs
from grpo_lightning.module.forward_options import ForwardOptions
from grpo_lightning.module.model_loading import load_tokenizer
from grpo_lightning.samplers.hf_generate import HFGenerateSampler
from grpo_lightning.tools import Toolbox
from grpo_lightning.types import GenerationParams
from tests.agents.scripted import Handle, ScriptedSampler, call
from tests.vlm.tiny_vlm import color_image, qwen2_vl_model, qwen_asset_processor

# A Qwen-style template with tool calls and image parts in any message (as Qwen3-VL's renders them).
TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.content is string %}{{ message.content }}"
    "{% else %}{% for part in message.content %}"
    "{% if part.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part.type == 'text' %}{{ part.text }}{% endif %}{% endfor %}{% endif %}"
    "{% if message.tool_calls %}{% for c in message.tool_calls %}"
    "{% if message.content or not loop.first %}\n{% endif %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPT_IMAGE, TOOL_IMAGE = color_image(0, (56, 28)), color_image(1, (28, 56))  # grids (1, 2, 4) and (1, 4, 2)
ANSWER = "It is blue."


def look(kind: str) -> list | str:
    """Looks at the scene.

    Args:
        kind: "image" for a picture, anything else for a description.
    """
    if kind == "image":
        return [{"type": "image", "image": TOOL_IMAGE}, {"type": "text", "text": "the scene"}]
    return "a blue scene"


def script(context: str, k: int) -> str:
    if "<|im_start|>tool" in context:
        return ANSWER
    return call("look", kind="image" if "picture" in context else "text")


class ImageScripted(ScriptedSampler):
    """The scripted policy, taking image inputs; records each call's prompts as given."""

    supports_images = True

    def __init__(self) -> None:
        super().__init__(script)
        self.prompts: list[list] = []

    def generate(self, prompts, num_generations, params):
        self.prompts.append(list(prompts))
        return super().generate(prompts, num_generations, params)


@pytest.fixture(scope="module")
def processor(shared_assets):
    return qwen_asset_processor(shared_assets)


@pytest.fixture
def episode(processor):
    return _episode(processor)


def _episode(processor, template=TEMPLATE):
    """Row 0: an image prompt whose tool returns an image; row 1: a text prompt, text tool result."""
    tokenizer = load_tokenizer(processor)
    inner = ImageScripted()
    agent = AgentSampler(inner, Toolbox.of([look]), parser="hermes", chat_template=template)
    agent.bind(Handle(tokenizer))
    user = [{"role": "user", "content": "What colour is the picture?"}]
    image_prompt = encode_multimodal_prompt(user, [PROMPT_IMAGE], processor, 0, {"chat_template": template})
    text_prompt = agent.render_prompt([{"role": "user", "content": "Say the colour."}], Toolbox.of([]))
    rollouts = agent.generate([image_prompt, text_prompt], 1, GenerationParams(max_completion_length=200))
    return agent, inner, tokenizer, image_prompt, rollouts


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def test_tool_images_are_rendered_by_the_processor_and_feed_the_next_turn(episode, processor):
    _, inner, tokenizer, prompt, (row, text_row) = episode
    first, last = _ids(tokenizer, call("look", kind="image")), _ids(tokenizer, ANSWER)
    n_tool = len(row.completion_ids) - len(first) - len(last)
    tool = row.completion_ids[len(first) : len(first) + n_tool]
    assert row.completion_ids == first + tool + last  # generated ids + tool ids, exactly
    assert row.tool_mask == [1] * len(first) + [0] * n_tool + [1] * len(last)
    pad = processor.image_token_id
    assert tool.count(pad) == 8 // 4  # 8 patches merged 2x2
    # Independently: the processor's rendering of the whole conversation, both images.
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the picture?"}]},
                {"role": "assistant", "content": call("look", kind="image")},
                {"role": "tool", "name": "look", "content": [{"type": "image"}, {"type": "text", "text": "the scene"}]}]
    text = processor.apply_chat_template(messages, chat_template=TEMPLATE, add_generation_prompt=True, tokenize=False)
    expected = processor(text=[text], images=[[PROMPT_IMAGE, TOOL_IMAGE]], return_tensors="pt")
    context = list(prompt) + first + tool
    assert expected["input_ids"][0].tolist() == context
    inputs = row.model_inputs
    assert inputs.token_fields == ("mm_token_type_ids",)
    torch.testing.assert_close(inputs.rows["pixel_values"][0], expected["pixel_values"], rtol=0, atol=0)
    assert inputs.rows["image_grid_thw"][0].tolist() == [[1, 2, 4], [1, 4, 2]]  # prompt image, then tool image
    assert inputs.rows["pixel_values"][0].shape[0] == int(inputs.rows["image_grid_thw"][0].prod(-1).sum())
    types = torch.cat([inputs.rows["mm_token_type_ids"][0], inputs.completion_rows["mm_token_type_ids"][0]])
    full = torch.tensor(list(prompt) + row.completion_ids)
    assert types.tolist() == (full == pad).long().tolist()  # 1 exactly on the image tokens
    # The second turn's generate call received the grown inputs with prompt + completion so far.
    second = inner.prompts[1][0]
    assert list(second) == context
    assert second.images == [PROMPT_IMAGE, TOOL_IMAGE]  # raw, in token order: what a vLLM sampler sends
    torch.testing.assert_close(second.model_inputs["pixel_values"], expected["pixel_values"], rtol=0, atol=0)
    assert second.model_inputs["mm_token_type_ids"].tolist() == expected["mm_token_type_ids"][0].tolist()
    # Row 1 (text prompt, text tool result): text-rendered tool turn, empty image inputs.
    assert processor.image_token_id not in text_row.completion_ids
    assert text_row.model_inputs.rows["pixel_values"][0].shape == (0, 1176)
    assert text_row.extra["num_tool_calls"] == 1 and text_row.extra["tool_images"] == []
    assert row.extra["tool_images"] == [TOOL_IMAGE] and row.images == [PROMPT_IMAGE, TOOL_IMAGE]


def test_training_forward_on_the_final_sequence_sees_the_tool_image(episode, processor):
    _assert_forward_sees_the_tool_image(episode, qwen2_vl_model)


def test_qwen3_vl_tool_images_grow_the_inputs_and_reach_the_forward(shared_assets):
    """Qwen3-VL (the seed's tool-images family): other patch size (16), interleaved M-RoPE."""
    from tests.vlm.tiny_vlm import asset_processor, qwen3_vl_model

    processor = asset_processor("qwen3_vl", shared_assets)
    episode = _episode(processor)
    row = episode[4][0]
    inputs = row.model_inputs
    grids = inputs.rows["image_grid_thw"][0]
    assert len(grids) == 2 and inputs.rows["pixel_values"][0].shape[0] == int(grids.prod(-1).sum())  # prompt + tool
    types = torch.cat([inputs.rows["mm_token_type_ids"][0], inputs.completion_rows["mm_token_type_ids"][0]])
    full = torch.tensor(list(row.prompt_ids) + row.completion_ids)
    assert types.tolist() == (full == processor.image_token_id).long().tolist()
    assert int(types[len(row.prompt_ids):].sum()) == int(grids[1].prod()) // 4  # the tool image's tokens (2x2 merge)
    _assert_forward_sees_the_tool_image(episode, qwen3_vl_model)


def _assert_forward_sees_the_tool_image(episode, build_model):
    """The batch's forward of row 0 equals a plain model call on its full ids and pixels, and the
    answer after the tool image depends on the pixels."""
    _, _, tokenizer, _, rollouts = episode
    model = build_model(tokenizer).double().eval()
    pad = tokenizer.pad_token_id
    prompt_ids, prompt_mask = pad_sequences([r.prompt_ids for r in rollouts], value=pad, side="left")
    completion_ids, completion_mask = pad_sequences([r.completion_ids for r in rollouts], value=pad, side="right")
    batch_inputs = row_inputs_of(rollouts)
    with torch.no_grad():
        logps, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 1.0,
                                       options=ForwardOptions.plain(), model_inputs=batch_inputs)
        row = rollouts[0]
        ids = torch.tensor([row.prompt_ids + row.completion_ids])
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **_full_inputs(row.model_inputs)).logits[0].double()
        expected = logits[len(row.prompt_ids) - 1 : -1].log_softmax(-1).gather(-1, torch.tensor(row.completion_ids)[:, None])[:, 0]
        blind = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].double()  # no pixels at all
    n = len(row.completion_ids)
    torch.testing.assert_close(logps[0, :n].double(), expected, rtol=0, atol=4e-6)
    tail = slice(n - len(_ids(tokenizer, ANSWER)), n)  # after the tool image: the answer tokens
    blind_logps = blind[len(row.prompt_ids) - 1 : -1].log_softmax(-1).gather(-1, torch.tensor(row.completion_ids)[:, None])[:, 0]
    assert (blind_logps[tail] - expected[tail]).abs().max() > 1e-3  # the pixels change the answer's log-probs


def test_hf_generate_takes_the_grown_inputs(episode, processor):
    """The real back-end generates the second turn from the recorded context with its pixels:
    greedy's first token is the argmax of a plain model call on the full ids and pixels."""
    from grpo_lightning.module.grpo_module import GRPOModule
    from tests.helpers import built

    _, inner, tokenizer, _, _ = episode
    model = qwen2_vl_model(tokenizer).double().eval()
    module = built(GRPOModule(model, tokenizer=processor, save_final_model=False))
    sampler = HFGenerateSampler()
    sampler.bind(module)
    context = inner.prompts[1][0]
    out = sampler.generate([context], 1, GenerationParams(max_completion_length=1, generation_kwargs={"do_sample": False}))
    ids = torch.tensor([list(context)])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **{k: (v[None] if k == "mm_token_type_ids" else v)
                       for k, v in context.model_inputs.items()}).logits[0, -1]
    assert out[0].completion_ids[0] == int(logits.argmax())


def test_text_only_policy_keeps_text_rendering_and_warns(processor, caplog):
    tokenizer = processor.tokenizer.__class__.from_pretrained(processor.tokenizer.name_or_path)
    inner = ScriptedSampler(script)
    agent = AgentSampler(inner, Toolbox.of([look]), parser="hermes", chat_template=TEMPLATE)
    agent.bind(Handle(tokenizer))
    prompt = agent.render_prompt([{"role": "user", "content": "What colour is the picture?"}], Toolbox.of([look]))
    with caplog.at_level(logging.WARNING):
        (row,) = agent.generate([prompt], 1, GenerationParams(max_completion_length=200))
    assert processor.image_token_id not in row.completion_ids and row.model_inputs is None
    assert row.extra["tool_images"] == [TOOL_IMAGE]
    assert "no multimodal processor" in caplog.text


def test_a_sampler_without_images_is_refused(processor):
    tokenizer = load_tokenizer(processor)
    agent = AgentSampler(ScriptedSampler(script), Toolbox.of([look]), parser="hermes", chat_template=TEMPLATE)
    agent.bind(Handle(tokenizer))
    prompt = agent.render_prompt([{"role": "user", "content": "What colour is the picture?"}], Toolbox.of([look]))
    with pytest.raises(Exception, match="does not take image inputs"):
        agent.generate([prompt], 1, GenerationParams(max_completion_length=200))


def test_a_masked_row_keeps_its_tool_image_tokens_when_rows_are_selected(episode):
    """A row whose completion mask is zeroed (a masked truncation) keeps its full completion in a
    row selection (micro-batches, token-budget groups): its tool image tokens match its pixels."""
    from grpo_lightning.types import RolloutBatch

    _, _, tokenizer, _, rollouts = episode
    pad = tokenizer.pad_token_id
    prompt_ids, prompt_mask = pad_sequences([r.prompt_ids for r in rollouts], value=pad, side="left")
    completion_ids, completion_mask = pad_sequences([r.completion_ids for r in rollouts], value=pad, side="right")
    completion_mask[0] = 0
    batch = RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, torch.zeros(2), torch.tensor(0.0),
                         torch.zeros(2, dtype=torch.long), model_inputs=row_inputs_of(rollouts))
    picked = batch.select_rows(torch.tensor([0]))
    assert picked.completion_ids[0].tolist() == rollouts[0].completion_ids
    model = qwen2_vl_model(tokenizer).double().eval()
    with torch.no_grad():  # image tokens and pixels agree (Qwen2-VL raises otherwise)
        completion_logprobs(model, picked.prompt_ids, picked.prompt_mask, picked.completion_ids, picked.completion_mask,
                            1.0, options=ForwardOptions.plain(), model_inputs=picked.model_inputs)


def alternating(context: str, k: int) -> str:
    """Even rows of a call look at a picture, odd rows get a description; then they answer."""
    if "<|im_start|>tool" in context:
        return ANSWER
    return call("look", kind="image" if k % 2 == 0 else "text")


def saw_image(completions, tool_images, **kwargs):
    """1 for a rollout whose tool returned an image: non-zero advantages within each group."""
    return [float(len(images)) for images in tool_images]


@pytest.mark.slow
def test_two_trainer_steps_with_a_tool_returning_images(tmp_path, processor):
    import lightning.pytorch as pl

    from grpo_lightning.agents import AgentSettings
    from grpo_lightning.data import RolloutDataModule
    from grpo_lightning.module import GRPOModule

    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What colour is it? {i}"}]}) + "\n"
                            for i in range(4)))
    seen = []

    class Record(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            seen.append(batch)

    model = qwen2_vl_model(processor.tokenizer)
    module = GRPOModule(model, tokenizer=processor, learning_rate=1e-2, lr_scheduler_type="constant",
                        gradient_checkpointing=False, save_final_model=False)
    sampler = ImageScripted()
    sampler.script = alternating
    datamodule = RolloutDataModule(
        str(path), reward_funcs=[saw_image], num_generations=2, per_device_train_batch_size=4, sampler=sampler,
        generation=GenerationParams(max_completion_length=96),
        agent=AgentSettings(tools=[look], parser="hermes", chat_template=TEMPLATE),
    )
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                         callbacks=[Record()])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.fit(module, datamodule)
    assert trainer.global_step == 2 and seen
    for batch in seen:
        rows = batch.model_inputs.rows
        tool_images = batch.completion_ids == processor.image_token_id  # (B, T)
        # Half the rows (each group: the even generation) saw the tool image, the others none (empty inputs).
        assert sorted(g.shape[0] for g in rows["image_grid_thw"]) == [0, 0, 1, 1]
        for i, (grid, pixels) in enumerate(zip(rows["image_grid_thw"], rows["pixel_values"])):
            assert pixels.shape[0] == int(grid.prod(-1).sum())
            assert int(tool_images[i].sum()) == int(grid.prod(-1).sum()) // 4  # tokens = patches / (2x2 merge)
        assert not (batch.loss_mask.bool() & tool_images).any()
    changed = {n for n, p in module.policy.named_parameters() if not torch.equal(p, before[n])}
    assert any("visual" in n for n in changed), "the vision tower got no update: the tool image did not reach the loss"


def test_dataset_images_in_an_agent_run_reach_every_turn_and_the_batch(processor):
    """A dataset row with an image, in a tool-calling run (the builder wired as for data.agent):
    its prompt is rendered with the tool schemas *and* the image by the processor, the first turn
    and the turn after the tool's image get the pixels, and the trained batch carries both images."""
    from grpo_lightning.agents import AgentSettings
    from grpo_lightning.data.agent_wiring import wire_agent
    from grpo_lightning.data.prompt_order import GenerationPlan
    from grpo_lightning.data.rollout_builder import Collective, RolloutBuilder, RolloutSettings
    from grpo_lightning.rewards import RewardRunner, resolve_reward_funcs

    tokenizer = load_tokenizer(processor)
    settings = AgentSettings(tools=[look], parser="hermes", chat_template=TEMPLATE)
    _, funcs, weights, agent = wire_agent(settings, "unused.jsonl", [saw_image], None, ImageScripted(), {})
    handle = Handle(tokenizer, max_context_length=512)
    agent.bind(handle)
    plan = RolloutSettings(num_generations=2, plan=GenerationPlan(2, 1, 2, 2), gradient_accumulation_steps=1,
                           params=GenerationParams(max_completion_length=200))
    builder = RolloutBuilder(plan, agent, RewardRunner(resolve_reward_funcs(funcs), weights), handle, Collective())
    rows = [{"prompt": [{"role": "user", "content": "What colour is the picture?"}], "image": PROMPT_IMAGE}] * 2
    built = builder.build(rows, [0, 0], None)

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the picture?"}]}]
    text = processor.apply_chat_template(messages, chat_template=TEMPLATE, tools=Toolbox.of([look]).schemas,
                                         add_generation_prompt=True, tokenize=False)
    expected = processor(text=[text], images=[[PROMPT_IMAGE]], return_tensors="pt")
    first = agent.inner.prompts[0]
    assert len(first) == 1 and agent.inner.calls[0][1] == 2  # one prompt, its 2 completions as one group
    assert list(first[0]) == expected["input_ids"][0].tolist()  # tools and the expanded image tokens
    assert '"name": "look"' in tokenizer.decode(list(first[0]))
    assert first[0].images == [PROMPT_IMAGE]
    torch.testing.assert_close(first[0].model_inputs["pixel_values"], expected["pixel_values"], rtol=0, atol=0)
    second = agent.inner.prompts[1]
    assert [p.images for p in second] == [[PROMPT_IMAGE, TOOL_IMAGE]] * 2  # the prompt's image, then the tool's
    batch = built.micro_batches[0]
    assert [g.tolist() for g in batch.model_inputs.rows["image_grid_thw"]] == [[[1, 2, 4], [1, 4, 2]]] * 2
    assert batch.generation_metrics["tools/call_frequency"] == 1.0


# --------------------------------------------------------------------- the other image layouts
#: family -> (model builder, the image placeholder its chat template renders).
LAYOUT_FAMILIES = {
    "qwen3_vl": ("qwen3_vl_model", "<|vision_start|><|image_pad|><|vision_end|>"),  # grid
    "gemma3": ("gemma3_model", "<start_of_image>"),  # per image, token_type_ids
    "llava_next": ("llava_next_model", "<image>\n"),  # per image, tiles + image_sizes
    "idefics3": ("idefics3_model", "<image>"),  # batch-first + pixel_attention_mask
}


@pytest.fixture(scope="module", params=sorted(LAYOUT_FAMILIES))
def layout_family(request, shared_assets):
    from tests.vlm import tiny_vlm

    model_name, placeholder = LAYOUT_FAMILIES[request.param]
    processor = tiny_vlm.asset_processor(request.param, shared_assets)
    template = TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>", placeholder)
    return request.param, processor, getattr(tiny_vlm, model_name), template


def _full_inputs(row_inputs, row: int = 0) -> dict[str, torch.Tensor]:
    """One rollout's model keyword arguments over its whole sequence, as one batch row."""
    out = {k: v[row] for k, v in row_inputs.rows.items() if k not in row_inputs.token_fields}
    for name in row_inputs.token_fields:
        out[name] = torch.cat([row_inputs.rows[name][row], row_inputs.completion_rows[name][row]])[None]
    return out


def test_every_image_layout_renders_tool_images_like_its_processor_and_the_policy_sees_them(layout_family, monkeypatch):
    """For each layout (Qwen-VL grid, Gemma3 and LLaVA-NeXT per image, Idefics3 batch-first): the
    episode's ids and image inputs are the processor's own for the whole conversation, the batch's
    forward equals a plain model call on them (and the pixels change the answer), and HF generate's
    next turn takes them. The tool's image is square: LLaVA-NeXT cuts it into 2 tiles, the prompt's
    into 3, so the tool image's tiles are zero-padded as the processor pads them."""
    from grpo_lightning.module.grpo_module import GRPOModule
    from tests.helpers import built

    square = color_image(2, (30, 30))
    monkeypatch.setitem(look.__globals__, "TOOL_IMAGE", square)  # what the tool returns
    name, processor, build_model, template = layout_family
    agent, inner, tokenizer, prompt, rollouts = _episode(processor, template)
    row, text_row = rollouts
    first, last = _ids(tokenizer, call("look", kind="image")), _ids(tokenizer, ANSWER)
    tool = row.completion_ids[len(first) : len(row.completion_ids) - len(last)]
    assert row.completion_ids == first + tool + last
    assert row.tool_mask == [1] * len(first) + [0] * len(tool) + [1] * len(last)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the picture?"}]},
                {"role": "assistant", "content": call("look", kind="image")},
                {"role": "tool", "name": "look", "content": [{"type": "image"}, {"type": "text", "text": "the scene"}]}]
    text = processor.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=False)
    expected = processor(text=[text], images=[[PROMPT_IMAGE, square]], return_tensors="pt")
    context = list(prompt) + first + tool
    assert expected["input_ids"][0].tolist() == context
    full = _full_inputs(row.model_inputs)
    for key, value in full.items():  # pixels (both images, padded as the processor pads), grids, token types
        want = expected[key][:, : len(context)] if key in row.model_inputs.token_fields else expected[key]
        got = value[:, : len(context)] if key in row.model_inputs.token_fields else value
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{name}: {key}")
    assert sorted(full) == sorted(k for k in expected if k not in ("input_ids", "attention_mask"))
    second = inner.prompts[1][0]
    assert list(second) == context and second.images == [PROMPT_IMAGE, square]
    assert processor.tokenizer.convert_ids_to_tokens(text_row.completion_ids).count(processor.image_token) == 0
    _assert_forward_sees_the_tool_image((agent, inner, tokenizer, prompt, rollouts), build_model)
    # HF generate: the next turn's greedy token is the argmax of a plain call on the context and its pixels.
    model = build_model(tokenizer).double().eval()
    sampler = HFGenerateSampler()
    sampler.bind(built(GRPOModule(model, tokenizer=processor, save_final_model=False)))
    out = sampler.generate([second], 1, GenerationParams(max_completion_length=1, generation_kwargs={"do_sample": False}))
    ids = torch.tensor([list(second)])
    inputs = {k: (v[None] if k in second.token_fields else v) for k, v in second.model_inputs.items()}
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **inputs).logits[0, -1]
    assert out[0].completion_ids[0] == int(logits.argmax())


def test_a_processor_of_another_layout_is_refused_when_a_tool_returns_an_image(processor):
    """Mllama-like outputs (tiles per image, a cross-attention mask over tokens x images): refused
    with the supported layouts named, before any generation with wrong pixels."""
    from grpo_lightning.agents.tool_images import image_tool_turn
    from grpo_lightning.errors import ConfigError

    class TiledTemplate:
        def tool_turn_with_images(self, messages, names, processor):
            return [5, 6], {"input_ids": torch.zeros(1, 4, dtype=torch.long), "pixel_values": torch.zeros(1, 1, 4, 3, 8, 8),
                            "aspect_ratio_ids": torch.zeros(1, 1, dtype=torch.long),
                            "cross_attention_mask": torch.zeros(1, 4, 1, 4)}

    message = {"role": "tool", "content": [{"type": "image", "image": TOOL_IMAGE}]}
    with pytest.raises(ConfigError, match="aspect_ratio_ids.*Idefics3/SmolVLM"):
        image_tool_turn(TiledTemplate(), processor, [message], ["look"])


def test_appending_images_pads_the_dims_after_the_image_dim():
    """Batch-first rows (Idefics3: ``(1, images, 3, H, W)``) grow along dim 1, per-image ones along
    dim 0; images of other sizes are zero-padded bottom-right, as the processors pad a batch."""
    from grpo_lightning.agents.tool_images import append_images, image_axis, image_layout, no_images

    assert image_layout(["pixel_values", "pixel_attention_mask"]) == "batch_first" and image_axis(["pixel_attention_mask"]) == 1
    assert image_layout(["pixel_values", "image_grid_thw"]) == "grid" and image_layout(["pixel_values", "image_sizes"]) == "per_image"
    earlier, later = torch.ones(1, 1, 3, 4, 2), torch.full((1, 2, 3, 2, 5), 2.0)
    grown = append_images(earlier, later, axis=1)
    assert grown.shape == (1, 3, 3, 4, 5)
    assert grown[0, 0, :, :, :2].eq(1).all() and grown[0, 0, :, :, 2:].eq(0).all()
    assert grown[0, 1:, :, :2].eq(2).all() and grown[0, 1:, :, 2:].eq(0).all()
    assert no_images(earlier, 1).shape == (1, 0, 3, 4, 2) and no_images(later, 0).shape == (0, 2, 3, 2, 5)
    tiles = append_images(torch.ones(1, 3, 3, 2, 2), torch.ones(1, 2, 3, 2, 2), axis=0)  # LLaVA-NeXT: 3 and 2 tiles
    assert tiles.shape == (2, 3, 3, 2, 2) and tiles[1, 2].eq(0).all() and tiles[1, :2].eq(1).all()
