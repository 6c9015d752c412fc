"""configs/vlm/qwen2.5-vl-3b.yaml parses, and its recipe (LoRA on q/v projections, DAPO, prompt
settings, sampler) trains the tiny Qwen2-VL two steps on CPU."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest

from grpo_lightning.cli import GRPOLightningCLI, LogConfigToMLflow, TRAINER_DEFAULTS
from grpo_lightning.data import RolloutDataModule
from grpo_lightning.module import GRPOModule
from grpo_lightning.module.peft_settings import LoRASettings
from grpo_lightning.types import GenerationParams
from tests.vlm.test_vlm_training import write_image_prompts
from tests.vlm.tiny_vlm import qwen2_vl_model

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "vlm" / "qwen2.5-vl-3b.yaml"


class ParseOnly(GRPOLightningCLI):
    def instantiate_classes(self) -> None:
        pass


def parse(monkeypatch):
    monkeypatch.chdir(ROOT)
    cli = ParseOnly(GRPOModule, RolloutDataModule, trainer_defaults=TRAINER_DEFAULTS,
                    save_config_callback=LogConfigToMLflow, run=False, args=["--config", str(CONFIG)])
    return cli.config


def test_the_vlm_recipe_parses(monkeypatch):
    config = parse(monkeypatch)
    assert config.model.model == "Qwen/Qwen2.5-VL-3B-Instruct"
    assert config.model.peft_config.target_modules == ["q_proj", "v_proj"]
    assert config.trainer.precision == "bf16-mixed" and config.model.learning_rate == 1e-5
    assert config.data.generation.max_completion_length == 1024
    (logger,) = config.trainer.callbacks
    assert logger.init_args.log_multimodal is True


@pytest.mark.slow
def test_the_vlm_recipe_trains_the_tiny_model(monkeypatch, tmp_path, qwen_processor):
    config = parse(monkeypatch)
    lora = LoRASettings(**{k: v for k, v in vars(config.model.peft_config).items()})
    model = qwen2_vl_model(qwen_processor.tokenizer)
    module = GRPOModule(model, tokenizer=qwen_processor, peft_config=lora, learning_rate=1e-2,
                        lr_scheduler_type="constant", gradient_checkpointing=config.model.gradient_checkpointing,
                        loss=config.model.loss.class_path.rsplit(".", 1)[1].removesuffix("Loss").lower())
    data = config.data
    assert data.sampler.class_path == "grpo_lightning.samplers.HFGenerateSampler"  # the one taking images
    datamodule = RolloutDataModule(
        write_image_prompts(tmp_path), reward_funcs=["tests.helpers.length_reward"], prompt_column="prompt",
        system_prompt=data.system_prompt, num_generations=2, per_device_train_batch_size=4, sampler="hf_generate",
        generation=GenerationParams(max_completion_length=4, temperature=data.generation.temperature),
    )
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule)
    assert trainer.global_step == 2
    lora_params = {n: p for n, p in module.policy.named_parameters() if "lora_" in n}
    assert lora_params and all(p.requires_grad for p in lora_params.values())
    # Adapters only on the language model's q/v projections, none in the vision tower.
    assert all("language_model" in n and ("q_proj" in n or "v_proj" in n) for n in lora_params)
    trained = [n for n, p in lora_params.items() if "lora_B" in n and p.abs().sum() > 0]
    assert trained, "the LoRA B matrices (zero at init) did not move"
    frozen = [p for n, p in module.policy.named_parameters() if "lora_" not in n]
    assert not any(p.requires_grad for p in frozen)


@pytest.mark.slow
def test_a_4bit_vlm_with_lora_trains(tmp_path, qwen_processor):
    """QLoRA: the saved tiny Qwen2-VL loads in 4-bit (AutoModelForImageTextToText: its config has a
    vision_config) and its adapters train two steps."""
    pytest.importorskip("bitsandbytes")
    from grpo_lightning.module.peft_settings import QuantizationSettings

    folder = tmp_path / "model"
    qwen2_vl_model(qwen_processor.tokenizer).save_pretrained(folder)
    module = GRPOModule(str(folder), tokenizer=qwen_processor, learning_rate=1e-2, lr_scheduler_type="constant",
                        gradient_checkpointing=False, save_final_model=False,
                        peft_config=LoRASettings(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                        quantization_config=QuantizationSettings(load_in_4bit=True))
    datamodule = RolloutDataModule(write_image_prompts(tmp_path), reward_funcs=["tests.helpers.length_reward"],
                                   num_generations=2, per_device_train_batch_size=4,
                                   generation=GenerationParams(max_completion_length=3))
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule)
    assert trainer.global_step == 2
    assert type(module.policy.get_base_model()).__name__ == "Qwen2VLForConditionalGeneration"
    quantized = [n for n, m in module.policy.named_modules() if type(m).__name__ == "Linear4bit"]
    assert any("language_model" in n for n in quantized)
    assert any(p.abs().sum() > 0 for n, p in module.policy.named_parameters() if "lora_B" in n)
