"""``VLLMServerSampler``: generation by a separately started ``vllm serve`` (TRL's ``vllm_mode="server"``).

Layer L2; no vLLM import in the trainer for the ``gloo`` transport (``requests`` and torch only).
Weights travel by vLLM's native weight-update protocol (:mod:`.vllm_weight_senders`); every push
is verified with the weight probe against the server's prompt log-probs, under a deadline.
"""

from __future__ import annotations

import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from grpo_lightning.samplers.base import Sampler
from grpo_lightning.samplers.generation_checks import check_vllm_generation
from grpo_lightning.samplers.hf_common import completion_rollout
from grpo_lightning.samplers.vllm_common import (
    distributed_rank_and_world, engine_prompt, image_token_id, policy_weight_shapes, policy_weights, sampling_fields,
)
from grpo_lightning.samplers.vllm_server_client import VLLMServerClient, VLLMServerError
from grpo_lightning.samplers.vllm_weight_senders import SENDERS
from grpo_lightning.samplers.weight_probe import WeightProbe, WeightSyncError, run_with_deadline
from grpo_lightning.types import GenerationParams, PolicyHandle, PromptInput, Rollout

log = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}


class VLLMServerSampler(Sampler):
    """Samples from a ``vllm serve`` process on this or another node, pushing each new policy to it.

    Start the server first (the seed's two-node layout: inference on one node, training on the
    other), in dev mode with log-probs after sampling processing and a weight-transfer backend::

        VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --logprobs-mode processed_logprobs --max-logprobs -1 \\
            --weight-transfer-config '{"backend": "nccl"}'     # "gloo" on CPU (needs grpo-lightning there)

    At bind time the sampler waits for the server (``server_timeout``), checks its
    ``logprobs_mode`` and context length, and opens the weight transfer. Every rank sends its own
    prompts as token ids (``/v1/completions``) and pairs each returned choice with the prompt it
    asked for; trainer rank 0 pushes the weights, every rank takes part in gathering them.

    Image prompts (vision-language policies) go to vLLM's tokens-in/tokens-out route
    (``/inference/v1/generate``; start the server with ``--enable-scale-out`` too): the ids with one
    placeholder per image and the images as PNG ``data:`` URLs, which the server's processor
    expands; the expanded ids it returns must be the trainer's, or the batch is refused.

    Args:
        base_url: Server URL (``http://host:port``); overrides ``host``/``port`` (TRL
            ``vllm_server_base_url``).
        host: Server host (TRL ``vllm_server_host``).
        port: Server port (TRL ``vllm_server_port``).
        server_timeout: Seconds to wait for the server to answer ``/health`` (TRL ``vllm_server_timeout``).
        group_port: Port on this trainer for the weight-transfer rendezvous (TRL ``vllm_group_port``).
        weight_transfer_backend: ``"nccl"`` (GPU trainer and server; needs vLLM here too) or
            ``"gloo"`` (TCP, any device; the server needs grpo-lightning installed). Must match the
            server's ``--weight-transfer-config``.
        trainer_address: This trainer's address as the server reaches it; ``None``: the local
            address of the route to the server.
        structured_outputs_regex: Constrain every completion to this regex (TRL
            ``vllm_structured_outputs_regex``).
        request_timeout_s: Seconds one HTTP request (a whole generation batch) may take.
        verify_weights: After every push, compare the server's log-probs of a probe sequence with
            the policy's and raise ``WeightSyncError`` on a mismatch.
        sync_timeout_s: Seconds a push (transfer + verification) may take before it raises.
        probe_tolerance: Largest allowed probe log-prob difference; ``None`` derives it from dtypes.
        chunk_bytes: Bytes per broadcast of the ``gloo`` transport.
        max_concurrent_requests: Prompts in flight at once. Each prompt is one request (``n``
            completions, its own seed drawn from torch's generator: reproducible under a fixed
            seed, independent between prompts); the server batches concurrent requests.
    """

    name = "vllm_server"
    provides_logprobs = True
    keeps_own_weights = True
    #: Image prompts are sent with their images (``/inference/v1/generate``), see docs/vlm.md.
    supports_images = True

    def __init__(
        self,
        base_url: str | None = None,
        host: str = "0.0.0.0",
        port: int = 8000,
        server_timeout: float = 240.0,
        group_port: int = 51216,
        weight_transfer_backend: str = "nccl",
        trainer_address: str | None = None,
        structured_outputs_regex: str | None = None,
        request_timeout_s: float = 600.0,
        verify_weights: bool = True,
        sync_timeout_s: float | None = 600.0,
        probe_tolerance: float | None = None,
        chunk_bytes: int = 64 * 2**20,
        max_concurrent_requests: int = 64,
    ) -> None:
        super().__init__()
        if weight_transfer_backend not in SENDERS:
            raise ValueError(f"weight_transfer_backend={weight_transfer_backend!r}: use one of {sorted(SENDERS)} "
                             "(the backend of the server's --weight-transfer-config).")
        if server_timeout <= 0 or request_timeout_s <= 0:
            raise ValueError("server_timeout and request_timeout_s must be positive numbers of seconds.")
        if sync_timeout_s is not None and sync_timeout_s <= 0:
            raise ValueError(f"sync_timeout_s={sync_timeout_s}: use a positive number of seconds or None.")
        self.base_url = base_url or f"http://{host}:{port}"
        self.server_timeout = server_timeout
        self.group_port = group_port
        self.weight_transfer_backend = weight_transfer_backend
        self.trainer_address = trainer_address
        self.structured_outputs_regex = structured_outputs_regex
        self.request_timeout_s = request_timeout_s
        self.verify_weights = verify_weights
        self.sync_timeout_s = sync_timeout_s
        self.probe_tolerance = probe_tolerance
        self.chunk_bytes = chunk_bytes
        if max_concurrent_requests < 1:
            raise ValueError(f"max_concurrent_requests={max_concurrent_requests}: use 1 or more.")
        self.max_concurrent_requests = max_concurrent_requests
        self.client: VLLMServerClient | None = None
        self.sender: Any = None
        self.engine_dtype = torch.float32
        self.max_model_len: int | None = None
        self.last_push_seconds: float | None = None

    # ------------------------------------------------------------------ lifecycle
    def check_generation(self, params: GenerationParams) -> None:
        # The server checks the names of its request fields itself (vLLM need not be installed here).
        check_vllm_generation(params, "data.sampler: vllm_server", known=None)

    def bind(self, handle: PolicyHandle) -> None:
        """Wait for the server and check its configuration (before any training compute)."""
        super().bind(handle)
        if self.client is not None:
            return
        client = VLLMServerClient(self.base_url, self.request_timeout_s)
        client.wait_until_up(self.server_timeout)
        config = client.vllm_config()
        model_config = config.get("model_config", {})
        mode = model_config.get("logprobs_mode")
        if mode != "processed_logprobs":
            raise VLLMServerError(
                f"The vLLM server at {self.base_url} returns logprobs_mode={mode!r}: the importance-sampling "
                "correction needs the log-probs of the distribution actually sampled. Restart it with "
                "--logprobs-mode processed_logprobs.")
        backend = (config.get("weight_transfer_config") or {}).get("backend")
        if backend != self.weight_transfer_backend:
            raise VLLMServerError(
                f"The vLLM server at {self.base_url} has weight-transfer backend {backend!r}, this sampler "
                f"{self.weight_transfer_backend!r}: start the server with --weight-transfer-config "
                f"'{{\"backend\": \"{self.weight_transfer_backend}\"}}' or set weight_transfer_backend to match.")
        self.engine_dtype = DTYPES.get(str(model_config.get("dtype", "float32")).removeprefix("torch."), torch.float32)
        self.max_model_len = client.max_model_len()
        self.client = client

    @property
    def max_sequence_length(self) -> int | None:
        """The server's ``max_model_len`` (known once connected)."""
        return self.max_model_len

    def push_weights(self, handle: PolicyHandle, version: int) -> None:
        """Rank 0 sends the policy (every rank gathers) and verifies the server serves it; every
        rank then knows the outcome, and all raise together on a failure."""
        self._served_version = None
        rank, world = distributed_rank_and_world()
        error: str | None = None
        if rank == 0:
            try:
                run_with_deadline(lambda: self._push(handle, version), self.sync_timeout_s,
                                  f"vLLM server weight push of policy version {version}")
            except BaseException as err:  # noqa: BLE001 - shared with the other ranks, then raised
                error = f"{type(err).__name__}: {err}"
                if world == 1:
                    raise
        else:
            self._take_part_in_gathers(handle)
        if world > 1:
            box = [error]
            torch.distributed.broadcast_object_list(box, src=0)
            if box[0] is not None:
                raise WeightSyncError(f"Rank 0's weight push failed: {box[0]}")

    def generate(self, prompts: Sequence[PromptInput], num_generations: int, params: GenerationParams) -> list[Rollout]:
        handle, client = self.handle, self._client()
        rows = [list(map(int, p)) for p in prompts]
        too_long = [i for i, r in enumerate(rows) if self.max_model_len and len(r) + params.max_completion_length > self.max_model_len]
        if too_long:
            raise ValueError(f"Prompt rows {too_long[:5]} with max_completion_length={params.max_completion_length} exceed "
                             f"the server's max_model_len={self.max_model_len}: start it with a larger --max-model-len.")
        version = self.served_version
        fields = {**sampling_fields(params, handle.eos_token_ids, self.structured_outputs_regex),
                  "skip_special_tokens": False}
        # One request per prompt, each with its own seed: a seed shared by a request's prompts
        # would give similar prompts the same random stream (correlated completions).
        seeds = torch.randint(0, 2**31 - 1, (len(rows),)).tolist()
        images = [list(getattr(p, "images", None) or []) for p in prompts]
        image_token = image_token_id(handle) if any(images) else None

        def request(job: tuple[list[int], list[Any], int]) -> list[dict[str, Any]]:
            ids, row_images, seed = job
            if not row_images:
                return client.completions([ids], n=num_generations, seed=seed, **fields)
            return _image_choices(client.generate_with_images(*_image_request(ids, row_images, image_token),
                                                              n=num_generations, seed=seed, **fields))

        with ThreadPoolExecutor(max_workers=max(1, min(self.max_concurrent_requests, len(rows)))) as pool:
            answers = list(pool.map(request, zip(rows, images, seeds)))
        stop = set(handle.eos_token_ids)
        rollouts = []
        for row, (prompt, choices) in enumerate(zip(rows, answers)):
            if len(choices) != num_generations:
                raise VLLMServerError(f"The server returned {len(choices)} completions for prompt row {row}, "
                                      f"asked {num_generations}.")
            for choice in choices:
                if list(choice.get("prompt_token_ids") or []) != prompt:
                    raise VLLMServerError(f"A completion returned for prompt row {row} was generated for another "
                                          "prompt (or the server expanded its image placeholders differently from "
                                          "the trainer's processor): refusing to pair it with the wrong rollout.")
                logprobs = choice["logprobs"]["token_logprobs"]
                rollouts.append(completion_rollout(prompt, choice["token_ids"], stop, version, logprobs))
        return rollouts

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self.client is not None:
            self.client.close()
            self.client = None
        self._served_version = None

    # ------------------------------------------------------------------ weights
    def _client(self) -> VLLMServerClient:
        if self.client is None:
            raise RuntimeError("VLLMServerSampler is not connected: bind() first (the datamodule does this).")
        return self.client

    def _push(self, handle: PolicyHandle, version: int) -> None:
        client = self._client()
        start = time.perf_counter()
        if self.sender is None:
            self.sender = self._sender()
            self.sender.connect(client, client.world_size())
        shapes = policy_weight_shapes(handle)
        client.pause()
        try:
            with policy_weights(handle) as weights:
                self.sender.send(client, shapes, lambda: weights, str(version))
            client.reset_prefix_cache()  # cached prompt blocks hold the old weights' keys/values
            if image_token_id(handle) is not None:  # a VLM: image embeddings of the old vision tower
                client.reset_encoder_cache()
        finally:
            client.resume()
        served = client.weight_version()
        if served != str(version):
            raise WeightSyncError(f"After pushing policy version {version} the server reports weight version {served!r}.")
        if self.verify_weights:
            probe = WeightProbe.of_sampler(self, handle)  # built once, at the first push
            image_token = image_token_id(handle)
            probe.verify(handle, client.prompt_logprobs, version=version,
                         engine_image_logprobs=lambda ids, images: client.prompt_logprobs(
                             *_image_request(ids, images, image_token), expanded=ids))
        self._served_version = version
        self.last_push_seconds = time.perf_counter() - start
        log.info("Pushed policy version %d to %s in %.2f s", version, self.base_url, self.last_push_seconds)

    def _take_part_in_gathers(self, handle: PolicyHandle) -> None:
        """Non-sending ranks walk the same weights (sharded tensors are gathered collectively)
        and run the probe's forward, so every collective of rank 0's push has its peers."""
        with policy_weights(handle) as weights:
            for _ in weights:
                pass
        if self.verify_weights:
            WeightProbe.of_sampler(self, handle).run_trainer_forwards(handle)
        self._served_version = None

    def _sender(self) -> Any:
        address = self.trainer_address or _route_address(self.base_url)
        if self.weight_transfer_backend == "gloo":
            timeout = self.sync_timeout_s or self.request_timeout_s
            return SENDERS["gloo"](address, self.group_port, timeout, self.chunk_bytes)
        return SENDERS["nccl"](address, self.group_port)


def _image_request(ids: list[int], images: list[Any], image_token: int | None) -> tuple[list[int], list[str]]:
    """An image prompt as the server takes it: its ids with one placeholder per image (the server's
    processor expands them again) and the images as ``data:`` URLs."""
    return engine_prompt(ids, images, image_token)["prompt_token_ids"], [_data_url(i) for i in images]


def _data_url(image: Any) -> str:
    """A PIL image as a ``data:image/png;base64,...`` URL (lossless: the server sees the trainer's pixels)."""
    import base64
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _image_choices(response: dict[str, Any]) -> list[dict[str, Any]]:
    """The choices of a ``/inference/v1/generate`` response in ``/v1/completions``' shape: each with
    the (expanded) ``prompt_token_ids``, its ``token_ids`` and ``logprobs.token_logprobs``."""
    prompt = response.get("prompt_token_ids")
    out = []
    for choice in response["choices"]:
        content = (choice.get("logprobs") or {}).get("content") or []
        if len(content) != len(choice["token_ids"]):
            raise VLLMServerError(f"/inference/v1/generate returned {len(content)} log-probs for "
                                  f"{len(choice['token_ids'])} tokens: the sampling correction needs one per token.")
        out.append({"prompt_token_ids": prompt, "token_ids": choice["token_ids"],
                    "logprobs": {"token_logprobs": [float(entry["logprob"]) for entry in content]}})
    return out


def _route_address(base_url: str) -> str:
    """This host's address on the route to the server (what the server's workers connect back to)."""
    from urllib.parse import urlparse

    host = urlparse(base_url).hostname or "127.0.0.1"
    if host in ("0.0.0.0", "localhost", "::", "127.0.0.1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((host, 9))  # UDP: no packet is sent; only the route is chosen
        return sock.getsockname()[0]


__all__ = ["VLLMServerSampler"]
