"""HTTP client of a ``vllm serve`` process: health, configuration, completions by token ids (with
images: the tokens-in/tokens-out route), and vLLM's native weight-update routes.

Layer L2, no vLLM import: a trainer talking to a remote server needs only ``requests`` (its
``update_*`` methods also make it a ``VLLMWeightSyncClient`` for vLLM's own trainer-side engines).
The weight-update and cache routes exist when the server runs with ``VLLM_SERVER_DEV_MODE=1``.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import requests

#: Returned while the server is starting or overloaded: worth retrying.
RETRY_STATUS = (500, 502, 503)


class VLLMServerError(RuntimeError):
    """A ``vllm serve`` process is unreachable, misconfigured, or answered with an error."""


class VLLMServerClient:
    """Talks to one ``vllm serve`` at ``base_url`` (``http://host:port``).

    Args:
        base_url: Server root URL, without ``/v1``.
        request_timeout_s: Seconds one request may take (generation requests included).
        retries: Extra attempts after a connection error or an HTTP 500/502/503.
    """

    def __init__(self, base_url: str, request_timeout_s: float = 600.0, retries: int = 3) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.request_timeout_s = request_timeout_s
        self.retries = retries
        self._local = threading.local()  # one Session per thread: generation requests run concurrently
        self._sessions: list[requests.Session] = []
        self._model: str | None = None

    @property
    def session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            self._sessions.append(session)
        return session

    # ------------------------------------------------------------------ plumbing
    def request(self, method: str, route: str, *, timeout: float | None = None, retry: bool = True,
                **kwargs: Any) -> Any:
        """``method route`` with JSON in and out; raises :class:`VLLMServerError` naming the route."""
        url = f"{self.base_url}{route}"
        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            try:
                response = self.session.request(method, url, timeout=timeout or self.request_timeout_s, **kwargs)
            except requests.RequestException as err:
                if attempt + 1 < attempts:
                    time.sleep(min(2.0**attempt, 8.0))
                    continue
                raise VLLMServerError(f"{method} {url} failed: {err}") from err
            if response.status_code in RETRY_STATUS and attempt + 1 < attempts:
                time.sleep(min(2.0**attempt, 8.0))
                continue
            if response.status_code == 404:
                raise VLLMServerError(
                    f"{method} {url}: 404. The server does not expose {route}: start it with "
                    "VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config (docs/samplers.md, vLLM server).")
            if response.status_code >= 400:
                raise VLLMServerError(f"{method} {url}: HTTP {response.status_code}: {response.text[:2000]}")
            if not response.content:
                return None
            try:
                return response.json()
            except ValueError:
                return response.text
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------ server state
    def wait_until_up(self, timeout_s: float, poll_s: float = 2.0) -> None:
        """Poll ``GET /health`` until it answers 200, or raise after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        last: str = "no answer"
        while True:
            try:
                response = self.session.get(f"{self.base_url}/health", timeout=max(poll_s, 1.0))
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}"
            except requests.RequestException as err:
                last = type(err).__name__
            if time.monotonic() >= deadline:
                raise VLLMServerError(
                    f"The vLLM server at {self.base_url} was not up within {timeout_s:g} s (server_timeout; last "
                    f"answer: {last}). Start it first, e.g. VLLM_SERVER_DEV_MODE=1 vllm serve MODEL "
                    "--logprobs-mode processed_logprobs --max-logprobs -1 --weight-transfer-config "
                    "'{\"backend\": \"nccl\"}', and check data.sampler.init_args.base_url / host / port.")
            time.sleep(poll_s)

    def vllm_config(self) -> dict[str, Any]:
        """The server's ``VllmConfig`` as JSON (``GET /server_info``, dev mode)."""
        return self.request("GET", "/server_info", params={"config_format": "json"})["vllm_config"]

    @property
    def model(self) -> str:
        """The served model's name (the ``model`` field of every completion request)."""
        if self._model is None:
            self._model = self.request("GET", "/v1/models")["data"][0]["id"]
        return self._model

    def max_model_len(self) -> int:
        return int(self.request("GET", "/v1/models")["data"][0]["max_model_len"])

    def world_size(self) -> int:
        """Inference workers across data, tensor and pipeline parallelism."""
        return int(self.request("GET", "/get_world_size")["world_size"])

    def weight_version(self) -> str | None:
        return self.request("GET", "/weight_info")["weight_version"]

    # ------------------------------------------------------------------ generation
    def completions(self, prompts: Sequence[Sequence[int]], **fields: Any) -> list[dict[str, Any]]:
        """``POST /v1/completions`` with token-id prompts (``return_token_ids``): the choices,
        prompt-major (``n`` per prompt). Safe to call from several threads at once."""
        body = {"model": self.model, "prompt": [list(map(int, p)) for p in prompts], "return_token_ids": True,
                **fields}
        return self.request("POST", "/v1/completions", json=body, retry=False)["choices"]

    def generate_with_images(self, token_ids: Sequence[int], image_urls: Sequence[str], **fields: Any) -> dict[str, Any]:
        """``POST /inference/v1/generate`` (vLLM's tokens-in/tokens-out route): ``token_ids`` with
        one image placeholder per image, the images as ``content_parts`` (``data:`` URLs) that the
        server's processor expands, ``fields`` as its ``sampling_params``. Returns the response:
        ``prompt_token_ids`` (expanded) and ``choices`` (``token_ids``, ``logprobs.content``).

        Raises:
            VLLMServerError: naming ``--enable-scale-out`` when the server has the route disabled.
        """
        body = {"model": self.model, "token_ids": list(map(int, token_ids)), "return_token_ids": True,
                "content_parts": [{"type": "image_url", "url": url} for url in image_urls], "sampling_params": fields}
        try:
            return self.request("POST", "/inference/v1/generate", json=body, retry=False)
        except VLLMServerError as err:
            if "HTTP 403" in str(err) or ": 404." in str(err):
                raise VLLMServerError(
                    f"The vLLM server at {self.base_url} does not serve /inference/v1/generate, the route that takes "
                    "image prompts as token ids: restart it with --enable-scale-out (vLLM >= 0.32).") from err
            raise

    def prompt_logprobs(self, token_ids: Sequence[int], image_urls: Sequence[str] = (),
                        expanded: Sequence[int] | None = None) -> list[float]:
        """The served model's log-probs of ``token_ids[1:]`` given their prefixes. With
        ``image_urls``, ``token_ids`` hold one placeholder per image and ``expanded`` is what the
        server's processor must expand them to (the ids the log-probs are of)."""
        fields = dict(max_tokens=1, prompt_logprobs=0, temperature=1.0, n=1)
        if not image_urls:
            entries = self.completions([token_ids], **fields)[0]["prompt_logprobs"]
            ids = list(token_ids)
        else:
            response = self.generate_with_images(token_ids, image_urls, **fields)
            ids = list(response.get("prompt_token_ids") or [])
            if ids != list(expanded or []):
                raise VLLMServerError("The server expanded the image placeholders differently from the trainer's "
                                      "processor: its log-probs cannot be compared.")
            entries = response["prompt_logprobs"]
        return [float(entries[i][str(int(ids[i]))]["logprob"]) for i in range(1, len(ids))]

    # ------------------------------------------------------------------ weight updates (native routes)
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.request("POST", "/init_weight_transfer_engine", json={"init_info": init_info}, retry=False)

    def pause(self) -> None:
        """Stop scheduling (requests in flight finish first) while weights change."""
        self.request("POST", "/pause", params={"mode": "wait"})

    def resume(self) -> None:
        self.request("POST", "/resume")

    def start_weight_update(self) -> None:
        self.request("POST", "/start_weight_update", json={"is_checkpoint_format": True}, retry=False)

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self.request("POST", "/update_weights", json={"update_info": update_info}, retry=False)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.request("POST", "/finish_weight_update", json={"weight_version": weight_version}, retry=False)

    def reset_prefix_cache(self) -> None:
        """Drop cached prompt blocks: they hold keys/values of the previous weights."""
        self.request("POST", "/reset_prefix_cache")

    def reset_encoder_cache(self) -> None:
        """Drop cached image embeddings: the vision tower that made them has new weights."""
        self.request("POST", "/reset_encoder_cache")

    def close(self) -> None:
        for session in self._sessions:
            session.close()
        self._sessions.clear()


__all__ = ["VLLMServerClient", "VLLMServerError"]
