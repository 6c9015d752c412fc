"""LoRA and QLoRA runs on CPU: only adapter weights train, the reference is the base model with no
second copy, the export holds a merged model that transformers loads and the adapter alone."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import pytest
import torch
import yaml

from grpo_lightning.data import RolloutDataModule
from grpo_lightning.losses import LOSSES
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.forward import ForwardOptions, completion_logprobs
from grpo_lightning.types import GenerationParams
from grpo_lightning.utils.tiny_models import build_char_tokenizer, build_tiny_causal_lm
from tests.helpers import ALPHABET, length_reward, make_model_dir, write_prompts
from tests.numerics import assert_close_f32

peft = pytest.importorskip("peft", reason="peft is not installed (pip install 'grpo-lightning[peft]')")

LORA = {"r": 4, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj", "o_proj"]}


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_assets")
    return {"model": make_model_dir(root / "model"), "prompts": write_prompts(root / "prompts.jsonl")}


class RecordBatches(pl.Callback):
    """Keeps every micro-batch (with its reference log-probs) and the policy's trainable weights at its step."""

    def __init__(self) -> None:
        self.batches: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(batch)


def fit(model_dir, prompts, root, *, loss="dapo", max_steps=3, callbacks=(), **module_kwargs):
    module = GRPOModule(model_dir, loss=loss, learning_rate=5e-2, lr_scheduler_type="constant", **module_kwargs)
    datamodule = RolloutDataModule(
        prompts, reward_funcs=[length_reward], num_generations=4, per_device_train_batch_size=8,
        generation=GenerationParams(max_completion_length=6),
    )
    trainer = pl.Trainer(
        max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(root), callbacks=list(callbacks), gradient_clip_val=1.0,
    )
    trainer.fit(module, datamodule)
    return module, trainer


def base_logprobs(base, batch):
    with torch.no_grad():
        return completion_logprobs(base, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask,
                                   batch.temperature, with_entropy=False, options=ForwardOptions.plain())[0]


def test_lora_run_trains_only_adapters_uses_the_base_as_reference_and_exports(assets, tmp_path):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(assets["model"])  # a separate copy: the expected reference
    recorder = RecordBatches()
    module, trainer = fit(assets["model"], assets["prompts"], tmp_path, loss=LOSSES["grpo"](beta=0.04),
                          callbacks=[recorder], peft_config=LORA)
    assert trainer.global_step == 3
    policy = module.policy

    # (a) only the adapters changed; every base weight is bit-identical (the export merged a copy)
    trained = policy.get_base_model().state_dict()
    for name, value in base.state_dict().items():
        key = name.replace(".weight", ".base_layer.weight") if any(
            name.endswith(f".{t}.weight") for t in LORA["target_modules"]) else name
        assert torch.equal(trained[key], value), f"base weight {name} changed"
    adapters = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    assert any(p.abs().sum() > 0 for n, p in adapters.items() if "lora_B" in n), "lora_B still zero: no update"
    optimized = [p for group in trainer.optimizers[0].param_groups for p in group["params"]]
    assert {id(p) for p in optimized} == {id(p) for p in adapters.values()}
    assert module.step_metrics["grad_norm"] > 0

    # (b) reference log-probs are the base model's; there is no second model
    assert module.ref_policy is None
    assert sum(p.numel() for p in module.parameters()) == sum(p.numel() for p in policy.parameters())
    assert sum(p.numel() for p in policy.parameters()) - sum(p.numel() for p in adapters.values()) == sum(
        p.numel() for p in base.parameters())
    for batch in recorder.batches:
        mask = batch.completion_mask.bool()
        want = base_logprobs(base, batch)
        assert batch.ref_logps is not None
        assert_close_f32(batch.ref_logps[mask], want[mask], reduction_size=200, scale=10.0, msg="reference")
    last = recorder.batches[-1]  # after two updates the policy is not the base any more
    assert not torch.allclose(base_logprobs(policy, last)[last.completion_mask.bool()],
                              last.ref_logps[last.completion_mask.bool()], atol=1e-4)

    # (c) the merged export loads with transformers and gives the trained policy's logits
    final = tmp_path / "final_model"
    merged = AutoModelForCausalLM.from_pretrained(final)
    assert not hasattr(merged, "peft_config") and type(merged).__name__ == "LlamaForCausalLM"
    assert (final / "tokenizer.json").exists() or (final / "tokenizer_config.json").exists()
    ids = torch.randint(3, 16, (3, 9), generator=torch.Generator().manual_seed(0))
    policy.eval()
    with torch.no_grad():
        want = policy(input_ids=ids).logits
        assert_close_f32(merged(input_ids=ids).logits, want, reduction_size=400, scale=float(want.abs().max()) + 1,
                         msg="merged logits")
        # the adapter alone, on a fresh base
        assert (final / "adapter" / "adapter_model.safetensors").exists()
        reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(assets["model"]), final / "adapter")
        assert_close_f32(reloaded(input_ids=ids).logits, want, reduction_size=400, scale=float(want.abs().max()) + 1,
                         msg="adapter logits")


def test_lora_config_from_yaml_through_grpo_fit(assets, tmp_path):
    from grpo_lightning.cli import main

    config = {
        "trainer": {"max_steps": 1, "accelerator": "cpu", "default_root_dir": str(tmp_path / "run"),
                    "enable_progress_bar": False, "logger": False},
        "model": {"model": assets["model"], "learning_rate": 1e-2,
                  "peft_config": {"r": 8, "lora_alpha": 32, "target_modules": ["q_proj", "v_proj"]}},
        "data": {"dataset": assets["prompts"], "reward_funcs": ["tests.helpers.length_reward"], "num_generations": 4,
                 "per_device_train_batch_size": 8, "generation": {"max_completion_length": 4}},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    main(["fit", "--config", str(path)])
    adapter = yaml.safe_load((tmp_path / "run" / "final_model" / "adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 8 and adapter["lora_alpha"] == 32 and set(adapter["target_modules"]) == {"q_proj", "v_proj"}
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())  # the saved config re-runs the same job
    assert saved["model"]["peft_config"]["r"] == 8 and saved["model"]["quantization_config"] is None


def _qlora_model_dir(path):
    """A tiny Llama whose layer widths are multiples of 64 (bitsandbytes' 4-bit block)."""
    tokenizer = build_char_tokenizer(ALPHABET)
    build_tiny_causal_lm(len(tokenizer), hidden_size=64, num_heads=2, num_kv_heads=1).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("bits", [4, 8])
def test_qlora_step_on_cpu(assets, tmp_path, bits):
    pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install 'grpo-lightning[quantization]')")
    model_dir = _qlora_model_dir(tmp_path / "model64")
    quantization = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"} if bits == 4 else {"load_in_8bit": True}
    started = time.perf_counter()
    module, trainer = fit(model_dir, assets["prompts"], tmp_path, loss=LOSSES["grpo"](beta=0.04), max_steps=2,
                          peft_config={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"},
                          quantization_config=quantization)
    print(f"QLoRA {bits}-bit: 2 optimizer steps on CPU in {time.perf_counter() - started:.1f} s "
          f"(step_time {module.step_metrics['step_time']:.2f} s)")
    assert trainer.global_step == 2
    base = module.policy.get_base_model()
    assert getattr(base, f"is_loaded_in_{bits}bit")
    assert all("lora_" in n for n, p in module.policy.named_parameters() if p.requires_grad)
    assert any(p.abs().sum() > 0 for n, p in module.policy.named_parameters() if "lora_B" in n)
    assert module.ref_policy is None and torch.isfinite(torch.tensor(module.step_metrics["loss"]))
    # the merged export is an unquantized model that transformers loads
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final_model")
    assert merged.model.layers[0].self_attn.q_proj.weight.dtype == torch.float32


@pytest.mark.parametrize("bits", [None, pytest.param(4, marks=pytest.mark.slow)], ids=["lora", "qlora-4bit"])
def test_resume_from_a_checkpoint_restores_the_adapters_exactly(assets, tmp_path, bits):
    """A resumed LoRA/QLoRA run ends with the adapters of the run that never stopped (the
    quantized base is rebuilt from model.model; bitsandbytes' quant state is not loaded back)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    if bits:
        pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install 'grpo-lightning[quantization]')")
    model_dir = _qlora_model_dir(tmp_path / "model64") if bits else assets["model"]
    kwargs = dict(peft_config={"r": 4, "target_modules": "all-linear"}, save_final_model=False,
                  quantization_config={"load_in_4bit": True} if bits else None)

    def run(root, max_steps, ckpt_path=None, callbacks=()):
        module = GRPOModule(model_dir, loss=LOSSES["grpo"](beta=0.04), learning_rate=1e-2, **kwargs)
        datamodule = RolloutDataModule(assets["prompts"], reward_funcs=[length_reward], num_generations=4,
                                       per_device_train_batch_size=8, generation=GenerationParams(max_completion_length=4))
        trainer = pl.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=str(root), callbacks=list(callbacks))
        trainer.fit(module, datamodule, ckpt_path=ckpt_path)
        return {n: p.detach().clone() for n, p in module.policy.named_parameters() if p.requires_grad}

    checkpoints = ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=1, save_top_k=-1)
    straight = run(tmp_path / "a", 2, callbacks=[checkpoints])
    resumed = run(tmp_path / "b", 2, ckpt_path=str(tmp_path / "ckpt" / "epoch=0-step=1.ckpt"))
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[n], resumed[n]) for n in straight)
