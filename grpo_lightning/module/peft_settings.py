"""``model.peft_config`` (LoRA) and ``model.quantization_config`` (bitsandbytes): the YAML schema
and its checks, which run in ``GRPOModule.__init__``, before any weights load.

peft and bitsandbytes are optional extras (``[peft]``, ``[quantization]``), imported only when a
run asks for them. See ``docs/peft.md``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from grpo_lightning.errors import ConfigError

PEFT_EXTRA = "pip install 'grpo-lightning[peft]'"
QUANTIZATION_EXTRA = "pip install 'grpo-lightning[quantization]'"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class LoRASettings:
    """A LoRA adapter on the policy (``peft.LoraConfig``, task ``CAUSAL_LM``): only its weights train.

    Args:
        r: Rank of the adapter matrices.
        lora_alpha: Scaling numerator: the update is ``(lora_alpha / r) · B A`` (``/ sqrt(r)``
            with ``use_rslora``).
        lora_dropout: Dropout on the adapter's input (0 with ``model.disable_dropout``).
        target_modules: Module names that get an adapter (matched against the ends of the model's
            module names, e.g. ``[q_proj, v_proj]``), a regular expression matched against whole
            names, ``all-linear`` (every linear layer but the LM head), or ``null`` (peft's
            default for the architecture: ``q_proj, v_proj`` for Llama/Qwen2).
        modules_to_save: Modules trained in full besides the adapters (e.g. ``[lm_head]``).
        bias: Which biases train: ``none``, ``all`` or ``lora_only``.
        use_rslora: Rank-stabilised scaling ``lora_alpha / sqrt(r)``.
        use_dora: Weight-decomposed LoRA (DoRA).
        init_lora_weights: ``true`` (B = 0: the policy starts as the base model), ``false``
            (random B, for tests), or a peft initialisation name (``gaussian``, ``pissa``, ``olora``, ...).
        layers_to_transform: Only these layer indices get adapters (``null``: all).
        exclude_modules: Module names (or a regular expression) never adapted.
    """

    r: int = 8
    lora_alpha: int = 8
    lora_dropout: float = 0.0
    target_modules: list[str] | str | None = None
    modules_to_save: list[str] | None = None
    bias: Literal["none", "all", "lora_only"] = "none"
    use_rslora: bool = False
    use_dora: bool = False
    init_lora_weights: bool | str = True
    layers_to_transform: list[int] | None = None
    exclude_modules: list[str] | str | None = None

    def __post_init__(self) -> None:
        if self.r < 1:
            raise ConfigError(f"model.peft_config.r={self.r}: the adapter rank must be >= 1.")
        if self.lora_alpha <= 0:
            raise ConfigError(f"model.peft_config.lora_alpha={self.lora_alpha}: it must be > 0.")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ConfigError(f"model.peft_config.lora_dropout={self.lora_dropout}: use a probability in [0, 1).")
        if isinstance(self.target_modules, list) and not self.target_modules:
            raise ConfigError("model.peft_config.target_modules=[]: name at least one module, or use all-linear.")

    def to_peft(self) -> Any:
        """The ``peft.LoraConfig`` these settings describe."""
        peft = import_peft()
        fields = {k: getattr(self, k) for k in self.__dataclass_fields__}
        return peft.LoraConfig(task_type="CAUSAL_LM", **fields)


@dataclass(frozen=True)
class QuantizationSettings:
    """Load the base weights quantized with bitsandbytes (QLoRA): a ``BitsAndBytesConfig``.

    Needs ``model.peft_config`` (quantized weights do not train; the adapters do). Works on CPU
    (slowly) and CUDA; 4-bit needs layer widths divisible by 64 (the quantization block).

    Args:
        load_in_4bit: 4-bit weights (``nf4``/``fp4``), the QLoRA setting.
        load_in_8bit: LLM.int8 weights. Exactly one of the two must be true.
        bnb_4bit_quant_type: ``nf4`` (QLoRA's NormalFloat) or ``fp4``.
        bnb_4bit_compute_dtype: Dtype the 4-bit layers dequantize to for their matmuls
            (``bfloat16`` on GPUs; ``float32`` is the safe CPU choice).
        bnb_4bit_use_double_quant: Also quantize the quantization constants (~0.4 bit/parameter saved).
        bnb_4bit_quant_storage: Storage dtype of the packed 4-bit weights (FSDP wants it equal to
            the other weights' dtype).
        llm_int8_skip_modules: Modules kept unquantized (``null``: transformers' default, the LM head).
    """

    load_in_4bit: bool = False
    load_in_8bit: bool = False
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = "nf4"
    bnb_4bit_compute_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    bnb_4bit_use_double_quant: bool = False
    bnb_4bit_quant_storage: Literal["uint8", "float32", "bfloat16", "float16"] = "uint8"
    llm_int8_skip_modules: list[str] | None = field(default=None)

    def __post_init__(self) -> None:
        if self.load_in_4bit == self.load_in_8bit:
            raise ConfigError(
                f"model.quantization_config: load_in_4bit={self.load_in_4bit} and load_in_8bit={self.load_in_8bit}; "
                "set exactly one of them to true (4-bit is QLoRA's setting)."
            )

    def to_transformers(self) -> Any:
        """The ``transformers.BitsAndBytesConfig`` these settings describe."""
        from transformers import BitsAndBytesConfig

        storage = {"uint8": torch.uint8, **_DTYPES}[self.bnb_4bit_quant_storage]
        return BitsAndBytesConfig(
            load_in_4bit=self.load_in_4bit,
            load_in_8bit=self.load_in_8bit,
            bnb_4bit_quant_type=self.bnb_4bit_quant_type,
            bnb_4bit_compute_dtype=_DTYPES[self.bnb_4bit_compute_dtype],
            bnb_4bit_use_double_quant=self.bnb_4bit_use_double_quant,
            bnb_4bit_quant_storage=storage,
            llm_int8_skip_modules=self.llm_int8_skip_modules,
        )


def import_peft() -> Any:
    try:
        import peft
    except ImportError as error:
        raise ImportError(f"model.peft_config needs the peft package: {PEFT_EXTRA}") from error
    return peft


def import_bitsandbytes() -> Any:
    try:
        import bitsandbytes
    except ImportError as error:
        raise ImportError(f"model.quantization_config needs the bitsandbytes package: {QUANTIZATION_EXTRA}") from error
    return bitsandbytes


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a peft ``PeftModel`` (checked without importing peft)."""
    return type(model).__module__.split(".")[0] == "peft"


def as_settings(value: Any, cls: type) -> Any:
    """``value`` as ``cls``: a ``cls``, a mapping of its fields (Python callers), or ``None``."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, dict):
        name = "peft_config" if cls is LoRASettings else "quantization_config"
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(
                f"model.{name}: unknown key(s) {unknown}; the keys are {sorted(cls.__dataclass_fields__)}."
            )
        return cls(**value)
    raise ConfigError(f"Expected a {cls.__name__} (or a dict of its fields), got {type(value).__name__}.")


def check_adapter_settings(
    model: Any,
    peft_config: LoRASettings | None,
    quantization_config: QuantizationSettings | None,
    *,
    model_init_kwargs: dict[str, Any] | None,
    trust_remote_code: bool = False,
) -> tuple[LoRASettings | None, QuantizationSettings | None]:
    """The settings as dataclasses (a dict of fields is accepted), after every check that needs no
    weights: one :class:`ConfigError` (or an ``ImportError`` naming the extra) naming the setting and the fix."""
    peft_config = as_settings(peft_config, LoRASettings)
    quantization_config = as_settings(quantization_config, QuantizationSettings)
    if "quantization_config" in (model_init_kwargs or {}):
        raise ConfigError(
            "model.model_init_kwargs.quantization_config: set model.quantization_config instead "
            "(e.g. {load_in_4bit: true, bnb_4bit_quant_type: nf4}), where it is checked and paired with peft_config."
        )
    if quantization_config is not None:
        if peft_config is None:
            raise ConfigError(
                "model.quantization_config is set without model.peft_config: quantized base weights cannot be "
                "trained. Add model.peft_config (e.g. {r: 16, lora_alpha: 32, target_modules: all-linear}) for "
                "QLoRA, or remove model.quantization_config."
            )
        if isinstance(model, torch.nn.Module):
            raise ConfigError(
                "model.quantization_config applies when model.model is a path or hub id; an instantiated model is "
                "used as given: load it quantized yourself (from_pretrained(..., quantization_config=...))."
            )
        import_bitsandbytes()
    if peft_config is None:
        return None, quantization_config
    import_peft()
    if is_peft_model(model):
        raise ConfigError(
            "model.peft_config is set but model.model is already a PeftModel: train its adapters as they are "
            "(peft_config: null), or pass the base model."
        )
    skeleton = model if isinstance(model, torch.nn.Module) else _meta_skeleton(model, trust_remote_code)
    if skeleton is not None:
        check_module_names(skeleton, peft_config)
    return peft_config, quantization_config


def _meta_skeleton(source: str, trust_remote_code: bool) -> torch.nn.Module | None:
    """The model built from its config on the meta device (no memory, no weights), or ``None``
    when its class cannot be built that way (then peft reports bad names when the weights load)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001 - a best-effort early check
        return None


def _matches(pattern: str, name: str) -> bool:
    return name == pattern or name.endswith("." + pattern)


def check_module_names(model: torch.nn.Module, settings: LoRASettings) -> None:
    """Every name in ``target_modules`` and ``modules_to_save`` names a module of ``model``, and
    the targets are layers peft can adapt (a trial ``get_peft_model`` on a meta copy when ``model``
    is a skeleton)."""
    names = [n for n, _ in model.named_modules() if n]
    leaves = sorted({n.rsplit(".", 1)[-1] for n in names if not n.rsplit(".", 1)[-1].isdigit()})
    options = "; the model's module names end in " + ", ".join(leaves[:30])
    targets = settings.target_modules
    if isinstance(targets, list):
        missing = [t for t in targets if not any(_matches(t, n) for n in names)]
        if missing:
            raise ConfigError(f"model.peft_config.target_modules: {missing} match no module of the model{options}.")
    elif isinstance(targets, str) and targets != "all-linear":
        if not any(re.fullmatch(targets, n) for n in names):
            raise ConfigError(
                f"model.peft_config.target_modules={targets!r} (a regular expression over whole module names, such as "
                f"'model.layers.0.self_attn.q_proj') matches no module{options}."
            )
    missing = [m for m in settings.modules_to_save or () if not any(_matches(m, n) for n in names)]
    if missing:
        raise ConfigError(f"model.peft_config.modules_to_save: {missing} match no module of the model{options}.")
    if next(iter(model.parameters()), torch.empty(0)).device.type == "meta":
        try:
            import_peft().get_peft_model(model, settings.to_peft())
        except (ValueError, TypeError, KeyError) as error:
            raise ConfigError(f"model.peft_config: peft cannot adapt this model: {error}") from error


# GRPOModule keeps these in the checkpoint's hyper-parameters: let torch.load(weights_only=True) rebuild them.
torch.serialization.add_safe_globals([LoRASettings, QuantizationSettings])
