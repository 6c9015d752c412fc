"""Checking that an inference engine serves the weights just pushed to it.

Layer L2, no vLLM import. After every push a sampler that keeps its own weights runs a
:class:`WeightProbe`: a short fixed token sequence whose per-token log-probs the engine computes
(vLLM ``prompt_logprobs``) and the trainer computes (a policy forward, ``log_softmax`` in float32),
compared in float64. A mismatch raises :class:`WeightSyncError` naming the largest difference,
its position and, when the engine's weights are readable in-process, the first parameter whose
engine copy differs (:func:`first_differing_parameter`). :func:`run_with_deadline` bounds a push or
a verification in time, so a stuck engine raises instead of hanging the run.

**Tolerance.** Two correct computations of the same log-probs differ by rounding error (the
model of ``tests/numerics.py``: ``SAFETY · sqrt(n) · eps · scale``). With ``scale`` the largest
logit magnitude of the probe (log-prob errors are relative to the logits) and ``eps`` that of the
coarser of the engine's and the policy's dtypes:

* float32 engine: ``2 · SAFETY · sqrt(hidden_size) · eps · scale`` — the last hidden state's dot
  products with the head (length ``hidden_size``) on two float32 paths (engine and trainer);
  earlier layers' rounding is renormalised by the norms. About 3e-5 for a tiny test model,
  a few 1e-3 for a 7B model: far below what one optimizer step moves log-probs.
* bfloat16/float16 engine: ``SAFETY · eps · scale`` — the rounding of the 16-bit logits alone
  (about 1 nat for bf16 at logits of 20). No useful bound exists for the drift of 16-bit
  arithmetic through many layers, so this catches weights that are missing, misnamed, corrupted
  or from another model (several nats), not a single small optimizer step; the version handshake
  (``served_version``) is what catches a skipped push. Pass ``tolerance`` to set your own.

``SAFETY = 8`` as in the tests' numerics.

**Vision-language policies.** The token sequence reaches the language model only, so a vision
tower the engine did not receive would pass it. When the policy's tokenizer carries a processor,
the probe also has an :class:`ImageProbe`: one user turn with a fixed synthetic image, encoded by
that processor, whose log-probs after the image depend on the vision tower and projector; the
engine computes them from the ids (one placeholder per image) and the raw image, with the same
tolerance.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence, TypeVar

import torch

from grpo_lightning.types import PolicyHandle
from grpo_lightning.utils.model_config import text_config
from grpo_lightning.utils.module_modes import eval_mode

SAFETY = 8.0
T = TypeVar("T")

#: vLLM fuses some checkpoint tensors into one parameter: its name -> the checkpoint parts.
FUSED_PARAMETERS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


class WeightSyncError(RuntimeError):
    """A weight push failed: the engine does not serve the pushed weights, or did not finish in time."""


@dataclass(frozen=True)
class ProbeReport:
    """The outcome of one probe: the largest engine-trainer log-prob difference and its bound."""

    max_abs_diff: float
    position: int  # index in the probe's token ids of the worst token (>= 1)
    tolerance: float
    engine_logprob: float
    trainer_logprob: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.tolerance


def probe_token_ids(vocab_size: int, length: int = 16) -> list[int]:
    """A fixed token sequence spread over the vocabulary, the same for every run of a model.

    >>> probe_token_ids(40, 6)
    [1, 26, 11, 36, 21, 6]
    """
    if vocab_size < 2 or length < 2:
        raise ValueError(f"A weight probe needs a vocabulary of >= 2 tokens and >= 2 ids (got {vocab_size}, {length}).")
    stride = max(1, round(vocab_size * 0.618)) | 1  # odd, about the golden ratio: no short cycles
    return [(1 + i * stride) % vocab_size for i in range(length)]


def coarser_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """The dtype with the largest machine epsilon."""
    return max(dtypes, key=lambda d: torch.finfo(d).eps)


def probe_tolerance(dtype: torch.dtype, scale: float, hidden_size: int) -> float:
    """The rounding bound of a probe log-prob computed in ``dtype`` (see the module docstring)."""
    eps = torch.finfo(dtype).eps
    scale = max(1.0, float(scale))
    if dtype == torch.float32 or dtype == torch.float64:
        return 2 * SAFETY * math.sqrt(hidden_size) * eps * scale
    return SAFETY * eps * scale


#: The probe image's size (width, height): small enough for any processor's pixel budget.
PROBE_IMAGE_SIZE = (64, 48)


def probe_image() -> Any:
    """A fixed RGB image with structure in both directions (three gradients), the same every run."""
    from PIL import Image

    ramp = Image.linear_gradient("L").resize(PROBE_IMAGE_SIZE)
    return Image.merge("RGB", (ramp, ramp.transpose(Image.Transpose.FLIP_LEFT_RIGHT),
                               ramp.transpose(Image.Transpose.ROTATE_180)))


@dataclass(frozen=True)
class ImageProbe:
    """The image half of a vision-language policy's probe: ``token_ids`` (the processor's
    expansion), the processor's other outputs in per-row form (``model_inputs``, token-aligned ones
    ``(L,)`` named by ``token_fields``) and the raw ``image`` for the engine."""

    token_ids: list[int]
    model_inputs: dict[str, torch.Tensor]
    token_fields: tuple[str, ...]
    image: Any

    @classmethod
    def for_processor(cls, processor: Any) -> "ImageProbe | None":
        """The probe of ``processor``'s model (``None`` for no processor). A user turn with the image
        and a question, through the processor's chat template (else its image token and the question)."""
        if processor is None:
            return None
        from grpo_lightning.utils.processor_outputs import split_processor_outputs

        question = "Describe the picture."
        try:
            text = processor.apply_chat_template(
                [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                add_generation_prompt=True, tokenize=False)
        except (ValueError, AttributeError, TypeError):  # no chat template
            token = getattr(processor, "image_token", None)
            if token is None:
                return None
            text = f"{token}{question}"
        image = probe_image()
        ids, inputs, fields = split_processor_outputs(processor(text=[text], images=[[image]], return_tensors="pt"))
        return cls(ids, inputs, fields, image)

    @torch.no_grad()
    def trainer_logprobs(self, model: torch.nn.Module, device: torch.device) -> tuple[torch.Tensor, float]:
        """``(L-1,)`` float64 log-probs of tokens ``1..L-1`` under ``model`` with the image, and the
        largest logit magnitude."""
        ids = torch.tensor([self.token_ids], dtype=torch.long, device=device)  # (1, L)
        inputs = {k: (v[None] if k in self.token_fields else v).to(device) for k, v in self.model_inputs.items()}
        with eval_mode(model):
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False, **inputs).logits[0, :-1]
        logits = logits.float()  # (L-1, V)
        logps = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]
        return logps.double().cpu(), float(logits.abs().max())


class WeightProbe:
    """Compares the engine's log-probs of a fixed token sequence with the trainer's.

    Args:
        token_ids: The probe sequence (see :func:`probe_token_ids`); its first token is context only.
        engine_dtype: The dtype the engine computes in; sets the tolerance with the policy's dtype.
        tolerance: A fixed bound on the largest absolute log-prob difference, instead of the derived one.
        image: The image half of a vision-language policy's probe (see the module docstring).
    """

    def __init__(self, token_ids: Sequence[int], engine_dtype: torch.dtype = torch.float32,
                 tolerance: float | None = None, image: ImageProbe | None = None) -> None:
        self.token_ids = [int(i) for i in token_ids]
        self.engine_dtype = engine_dtype
        self.tolerance = tolerance
        self.image = image

    @classmethod
    def for_handle(cls, handle: PolicyHandle, engine_dtype: torch.dtype = torch.float32, length: int = 16,
                   tolerance: float | None = None) -> "WeightProbe":
        """A probe for ``handle``'s model: ids within both the tokenizer's and the model's vocabulary,
        and an :class:`ImageProbe` when the tokenizer carries a multimodal processor."""
        vocab = getattr(handle.policy.config, "vocab_size", None) or len(handle.tokenizer)
        image = ImageProbe.for_processor(getattr(handle.tokenizer, "processor", None))
        return cls(probe_token_ids(min(vocab, len(handle.tokenizer)), length), engine_dtype, tolerance, image)

    @classmethod
    def of_sampler(cls, sampler: Any, handle: PolicyHandle) -> "WeightProbe":
        """A vLLM sampler's probe (its ``engine_dtype`` and ``probe_tolerance``), built at the first
        push and kept: the ids and the encoded probe image stay the same through a run, only the
        weights they go through change. Rebuilt if the tokenizer or the engine dtype changes."""
        key = (id(handle.tokenizer), sampler.engine_dtype, sampler.probe_tolerance)
        cached = sampler.__dict__.get("_weight_probe")
        if cached is None or cached[0] != key:
            cached = (key, cls.for_handle(handle, sampler.engine_dtype, tolerance=sampler.probe_tolerance))
            sampler._weight_probe = cached
        return cached[1]

    @torch.no_grad()
    def trainer_logprobs(self, handle: PolicyHandle) -> tuple[torch.Tensor, float]:
        """Log-probs of tokens ``1..L-1`` under the policy, ``(L-1,)`` float64, and the largest logit
        magnitude (the tolerance's scale). Run inside ``handle.generation_context()`` when sharded."""
        model = handle.policy
        ids = torch.tensor([self.token_ids], dtype=torch.long, device=handle.device)  # (1, L)
        with eval_mode(model):  # no dropout: deterministic, and no draw from training's random streams
            logits = model(input_ids=ids, use_cache=False).logits[0, :-1].float()  # (L-1, V)
        logps = torch.log_softmax(logits, dim=-1).gather(1, ids[0, 1:, None])[:, 0]  # (L-1,)
        return logps.double().cpu(), float(logits.abs().max())

    def bound(self, handle: PolicyHandle, scale: float) -> float:
        if self.tolerance is not None:
            return self.tolerance
        policy_dtype = next(handle.policy.parameters()).dtype
        hidden = int(getattr(text_config(handle.policy.config), "hidden_size", None) or 1)  # a VLM's: its LM's
        return probe_tolerance(coarser_dtype(self.engine_dtype, policy_dtype), scale, hidden)

    def compare(self, engine_logprobs: Sequence[float], trainer_logprobs: torch.Tensor, tolerance: float) -> ProbeReport:
        """The worst difference between the engine's log-probs of tokens ``1..L-1`` and the trainer's."""
        engine = torch.tensor([float(x) for x in engine_logprobs], dtype=torch.float64)
        if engine.shape != trainer_logprobs.shape:
            raise WeightSyncError(f"The engine returned {engine.numel()} probe log-probs for "
                                  f"{trainer_logprobs.numel()} probe tokens.")
        diff = (engine - trainer_logprobs).abs()
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)  # NaN is a mismatch
        worst = int(diff.argmax())
        return ProbeReport(float(diff[worst]), worst + 1, tolerance, float(engine[worst]), float(trainer_logprobs[worst]))

    def run_trainer_forwards(self, handle: PolicyHandle) -> None:
        """The trainer's probe forwards alone (ranks that do not compare still take part in the
        collectives of a sharded forward)."""
        self.trainer_logprobs(handle)
        if self.image is not None:
            self.image.trainer_logprobs(handle.policy, handle.device)

    def verify(self, handle: PolicyHandle, engine_logprobs: Callable[[list[int]], Sequence[float]], *,
               version: int | None = None, differing_parameter: Callable[[], str | None] | None = None,
               engine_image_logprobs: Callable[[list[int], list[Any]], Sequence[float]] | None = None) -> ProbeReport:
        """Raise :class:`WeightSyncError` unless the engine's probe log-probs match the policy's.

        Args:
            handle: The live policy.
            engine_logprobs: Given the probe ids, the engine's log-probs of tokens ``1..L-1``.
            version: The pushed policy version, for the message.
            differing_parameter: Called only on a mismatch: the name of the first parameter whose
                engine copy differs from the policy's (or None), for the message.
            engine_image_logprobs: Given the image probe's expanded ids and its images, the
                engine's log-probs of tokens ``1..L-1``; checked when the probe has an image.

        Returns:
            The token sequence's report (the image probe's, when it is the worse of the two).
        """
        trainer, scale = self.trainer_logprobs(handle)
        report = self.compare(engine_logprobs(list(self.token_ids)), trainer, self.bound(handle, scale))
        self._raise_unless_ok(report, self.token_ids, "probe token", version, differing_parameter, "")
        if self.image is None or engine_image_logprobs is None:
            return report
        trainer, scale = self.image.trainer_logprobs(handle.policy, handle.device)
        image_report = self.compare(engine_image_logprobs(list(self.image.token_ids), [self.image.image]), trainer,
                                    self.bound(handle, scale))
        self._raise_unless_ok(image_report, self.image.token_ids, "image-probe token", version, differing_parameter,
                              " The text probe matched: the image's tokens and those after them depend on the vision "
                              "tower and projector.")
        return max(report, image_report, key=lambda r: r.max_abs_diff / max(r.tolerance, 1e-30))

    @staticmethod
    def _raise_unless_ok(report: ProbeReport, token_ids: Sequence[int], what: str, version: int | None,
                         differing_parameter: Callable[[], str | None] | None, hint: str) -> None:
        if report.ok:
            return
        culprit = differing_parameter() if differing_parameter is not None else None
        where = f" First parameter that differs in the engine: {culprit}." if culprit else ""
        raise WeightSyncError(
            f"Weight push{'' if version is None else f' of policy version {version}'} not served: the engine's "
            f"log-prob of {what} {report.position} (id {token_ids[report.position]}) is "
            f"{report.engine_logprob:.6g}, the policy's {report.trainer_logprob:.6g} (max abs diff "
            f"{report.max_abs_diff:.3g} > tolerance {report.tolerance:.3g}).{hint}{where}"
        )


# ----------------------------------------------------------------------------- checksums
@dataclass(frozen=True)
class Checksum:
    """Order-free fingerprint of a tensor: ``Σ|x|`` and ``Σx²`` in float64. Both ignore layout
    (an engine may transpose, pad with zeros or repack its weights) and never cancel out."""

    abs_sum: float
    sq_sum: float

    @classmethod
    def of(cls, tensor: torch.Tensor) -> "Checksum":
        x = tensor.detach().to(torch.float64)
        return cls(float(x.abs().sum()), float((x * x).sum()))

    def __add__(self, other: "Checksum") -> "Checksum":
        return Checksum(self.abs_sum + other.abs_sum, self.sq_sum + other.sq_sum)

    def close_to(self, other: "Checksum", dtype: torch.dtype) -> bool:
        # Rounding every element to ``dtype`` moves |x| by <= eps/2 relative, x² by <= eps.
        rel = 2 * torch.finfo(dtype).eps
        return all(abs(a - b) <= rel * max(abs(a), abs(b)) + 1e-12
                   for a, b in ((self.abs_sum, other.abs_sum), (self.sq_sum, other.sq_sum)))


def checksums(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, Checksum]:
    """A :class:`Checksum` per named tensor (run it where the tensors live: in the engine's worker)."""
    return {name: Checksum.of(t) for name, t in named}


def first_differing_parameter(policy: Iterable[tuple[str, torch.Tensor]], engine: Mapping[str, Checksum],
                              dtype: torch.dtype) -> str | None:
    """The first policy weight (checkpoint name) whose engine copy's checksum differs, or None.

    Engine names that fuse several checkpoint tensors (``qkv_proj``, ``gate_up_proj``) are
    compared with the sum of their parts' checksums; policy weights the engine does not expose
    under either name (a tied head, ...) are skipped.
    """
    parts: dict[str, Checksum] = {}
    owners: dict[str, list[str]] = {}
    order: list[str] = []
    for name, tensor in policy:
        order.append(name)
        target = name
        if name not in engine:
            candidates = (name.replace(f".{piece}.", f".{fused}.")
                          for fused, pieces in FUSED_PARAMETERS.items() for piece in pieces)
            target = next((c for c in candidates if c != name and c in engine), name)
        if target not in engine:
            continue
        checksum = Checksum.of(tensor)
        parts[target] = parts[target] + checksum if target in parts else checksum
        owners.setdefault(target, []).append(name)
    bad = {t for t, c in parts.items() if not c.close_to(engine[t], dtype)}
    for name in order:
        target = next((t for t in bad if name in owners[t]), None)
        if target is not None:
            return name if target == name else f"{name} (engine parameter {target})"
    return None


# ------------------------------------------------------------------------------ deadline
def run_with_deadline(fn: Callable[[], T], timeout_s: float | None, what: str) -> T:
    """``fn()``, or :class:`WeightSyncError` if it has not returned after ``timeout_s`` seconds.

    ``fn`` runs in a daemon thread the caller waits on; Python cannot stop a thread, so on a
    timeout it is left running (it holds no lock of ours) and the engine must be treated as
    broken: the caller drops its served version and raises. ``None`` waits without a limit.
    An exception raised by ``fn`` is re-raised here.
    """
    if timeout_s is None:
        return fn()
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as err:  # noqa: BLE001 - handed to the caller's thread
            result["error"] = err

    thread = threading.Thread(target=target, name=f"grpo-{what}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise WeightSyncError(f"{what} did not finish within {timeout_s:g} s (sync_timeout_s): the engine is "
                              "treated as broken. Raise sync_timeout_s if the model is large, or check the engine.")
    if "error" in result:
        raise result["error"]
    return result["value"]


__all__ = [
    "Checksum", "FUSED_PARAMETERS", "ImageProbe", "ProbeReport", "WeightProbe", "WeightSyncError", "checksums",
    "coarser_dtype", "first_differing_parameter", "probe_image", "probe_token_ids", "probe_tolerance", "run_with_deadline",
]
