"""Async client for engines speaking SGLang's HTTP protocol (a real SGLang server or the torch engine).

Every call has a timeout; connection errors are retried a bounded number of times with backoff,
nothing else is. A GET is retried on any connection error; any other method only when the
connection was never established (engine not up yet, refused): a POST that reached the engine
may be running, and a /generate or weight update must not run twice. A semaphore bounds the
requests in flight. Non-2xx answers raise `EngineError` carrying the status and the engine's
message. With `ClientConfig.api_key` every request carries `Authorization: Bearer <key>` (the
torch engine's and SGLang's `--api-key`); the key is kept out of the config's repr and out of
every message and log line.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from slime.engines.protocol import check_api_key
from slime.utils.retry import RetryPolicy, retrying

logger = logging.getLogger(__name__)


class EngineError(Exception):
    """An engine answered with an error status, or could not be reached after the retries."""

    def __init__(self, message: str, status: int | None = None, url: str = ""):
        super().__init__(f"{url}: {message}" if url else message)
        self.status = status
        self.message = message
        self.url = url


@dataclass(frozen=True)
class ClientConfig:
    """How the client talks to one engine."""

    timeout_s: float = 600.0
    """Total time allowed for one call (a long generation included)."""
    connect_timeout_s: float = 10.0
    """Time allowed to open a connection."""
    max_retries: int = 3
    """Retries for connection errors only (for non-GET calls: only before the request was sent)."""
    retry_backoff_s: float = 0.5
    """First backoff; doubles each retry."""
    max_concurrency: int = 256
    """Most requests in flight from this client."""
    api_key: str | None = field(default=None, repr=False)
    """Sent as 'Authorization: Bearer KEY' on every request when set (not shown by repr)."""

    def __post_init__(self) -> None:
        if self.api_key is not None:
            check_api_key(self.api_key)


class EngineClient:
    """One engine (or a router in front of several). Use as `async with EngineClient(url) as c:`."""

    def __init__(self, base_url: str, config: ClientConfig | None = None):
        self.base_url = base_url.rstrip("/")
        self.config = config or ClientConfig()
        self._semaphore = asyncio.Semaphore(self.config.max_concurrency)
        self._retry = RetryPolicy(self.config.max_retries + 1, self.config.retry_backoff_s)
        self._session: aiohttp.ClientSession | None = None
        self.update_fingerprints: dict[str, Any] | None = None  # see _update
        self.parameter_names: list[str] | None = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
            connector = aiohttp.TCPConnector(limit=self.config.max_concurrency, force_close=False)
            self._session = aiohttp.ClientSession(headers=headers, connector=connector)
        return self._session

    async def request(
        self,
        method: str,
        path: str,
        payload: Any = None,
        timeout_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        """Send one call; return the decoded JSON (or text) body. Raises EngineError."""
        url = f"{self.base_url}{path}"
        timeout = aiohttp.ClientTimeout(
            total=timeout_s or self.config.timeout_s, sock_connect=self.config.connect_timeout_s
        )

        def retryable(e: BaseException) -> bool:
            # A GET may be sent again; any other call only if it never reached the engine.
            return isinstance(e, aiohttp.ClientConnectionError) and (method == "GET" or _never_connected(e))

        def on_retry(failures: int, e: BaseException, wait: float) -> None:
            logger.warning("connection to %s failed (%s); retry %d in %.1fs", url, e, failures, wait)

        async def once() -> Any:
            async with self._get_session().request(
                method, url, json=payload, timeout=timeout, headers=headers
            ) as resp:
                return await _decode(resp, url)

        async with self._semaphore:
            try:
                return await retrying(once, self._retry, retryable, on_retry)
            except aiohttp.ClientConnectionError as e:
                if not retryable(e):
                    raise EngineError(
                        f"connection lost during {method} {path} (not retried: the engine may "
                        f"have run it): {e}",
                        None,
                        self.base_url,
                    ) from e
                raise EngineError(
                    f"cannot reach engine after {self._retry.attempts} attempts: {e}", None, self.base_url
                ) from e
            except asyncio.TimeoutError as e:
                raise EngineError(
                    f"{method} {path} timed out after {timeout.total} s", None, self.base_url
                ) from e

    # ---- generation ---------------------------------------------------------------------------
    async def generate(
        self,
        input_ids: list[int] | list[list[int]] | None = None,
        *,
        text: Any = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        return_logprob: bool = False,
        rid: str | list[str] | None = None,
        top_logprobs_num: int | None = None,
        timeout_s: float | None = None,
        return_routed_experts: bool = False,
        lora_path: str | None = None,
        image_data: Any = None,
    ) -> Any:
        """SGLang's /generate. `image_data`: the prompt's images (SGLang's field: a list of data
        URLs, paths or URLs; for a batch, one such list per prompt)."""
        payload: dict[str, Any] = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        if lora_path is not None:
            payload["lora_path"] = lora_path
        if image_data:
            payload["image_data"] = image_data
        if input_ids is not None:
            payload["input_ids"] = input_ids
        if text is not None:
            payload["text"] = text
        if rid is not None:
            payload["rid"] = rid
        if top_logprobs_num:
            payload["top_logprobs_num"] = top_logprobs_num
        if return_routed_experts:
            payload["return_routed_experts"] = True
        return await self.request("POST", "/generate", payload, timeout_s)

    async def completions(self, **body: Any) -> Any:
        return await self.request("POST", "/v1/completions", body)

    # ---- status -------------------------------------------------------------------------------
    async def health(self) -> bool:
        try:
            await self.request("GET", "/health", timeout_s=self.config.connect_timeout_s)
            return True
        except EngineError:
            return False

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        try:
            await self.request("GET", "/health_generate", timeout_s=timeout_s)
            return True
        except EngineError:
            return False

    async def wait_healthy(self, timeout_s: float = 120.0, interval_s: float = 0.5) -> None:
        """Poll /health until it answers 200; EngineError after `timeout_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            try:
                timeout = aiohttp.ClientTimeout(total=min(5.0, timeout_s))
                async with self._get_session().get(f"{self.base_url}/health", timeout=timeout) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(interval_s)
        raise EngineError(f"engine not healthy after {timeout_s} s", None, self.base_url)

    async def _get_either(self, path: str, older: str) -> Any:
        """GET `path`, or `older` from engines without it (SGLang renamed its /get_* routes)."""
        try:
            return await self.request("GET", path)
        except EngineError as e:
            if e.status != 404:
                raise
            return await self.request("GET", older)

    async def get_model_info(self) -> dict[str, Any]:
        return await self._get_either("/model_info", "/get_model_info")

    async def get_server_info(self) -> dict[str, Any]:
        return await self._get_either("/server_info", "/get_server_info")

    async def get_weight_version(self) -> str:
        """The engine's weight version (SGLang >= 0.5.2x has no /get_weight_version: /model_info's)."""
        try:
            return str((await self.request("GET", "/get_weight_version"))["weight_version"])
        except EngineError as e:
            if e.status != 404:
                raise
            return str((await self.get_model_info())["weight_version"])

    async def begin_weight_update(self) -> bool:
        """Open SGLang's weight-update session (required around tensor and distributed updates
        since SGLang 0.5.2x); False when the engine has no sessions (404)."""
        try:
            await self.request("POST", "/begin_weight_update", {})
            return True
        except EngineError as e:
            if e.status != 404:
                raise
            return False

    async def end_weight_update(self) -> Any:
        return await self.request("POST", "/end_weight_update", {})

    # ---- control ------------------------------------------------------------------------------
    async def pause_generation(self, mode: str = "in_place") -> Any:
        return await self.request("POST", "/pause_generation", {"mode": mode})

    async def continue_generation(self) -> Any:
        return await self.request("POST", "/continue_generation", {})

    async def abort_request(self, rid: str | None = None, abort_all: bool = False) -> Any:
        return await self.request("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def flush_cache(self) -> Any:
        return await self.request("POST", "/flush_cache")

    # ---- weights and memory -------------------------------------------------------------------
    async def _update(self, path: str, body: dict[str, Any]) -> Any:
        """A weight update. With `update_fingerprints` set (--check-weight-sync), the engine is
        asked for the fingerprints of what it wrote (a slime torch-engine extension), which are
        gathered there, and the names of all its parameters into `parameter_names`."""
        if self.update_fingerprints is None:
            return await self.request("POST", path, body)
        result = await self.request("POST", path, {**body, "slime_fingerprints": True})
        if not (isinstance(result, dict) and isinstance(result.get("slime_fingerprints"), dict)):
            raise EngineError(
                f"{path} answered without 'slime_fingerprints': --check-weight-sync needs engines that "
                "report what they wrote (the torch engine does; SGLang does not)",
                url=self.base_url,
            )
        self.update_fingerprints.update(result["slime_fingerprints"])
        self.parameter_names = list(result.get("slime_parameter_names") or [])
        return result

    async def pull_weights(self, local_checkpoint_dir: str, source_dir: str, target_version: int) -> Any:
        """SGLang's /pull_weights: this engine's hosts bring their local checkpoint to
        `target_version` of the versions under `source_dir` (slime.utils.weight_delta)."""
        body = {
            "local_checkpoint_dir": local_checkpoint_dir,
            "source_dir": source_dir,
            "target_version": target_version,
        }
        result = await self.request("POST", "/pull_weights", body)
        if isinstance(result, dict) and result.get("success") is False:
            raise EngineError(f"/pull_weights: {_error_message(result)}", None, self.base_url)
        return result

    async def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> Any:
        # flush_cache false, as on every update: SGLang's default (true) fails the update while
        # paused requests hold KV cache; the bridge flushes before the push where it can.
        return await self._update(
            "/update_weights_from_disk",
            _drop_none({"model_path": model_path, "weight_version": weight_version, "flush_cache": False}),
        )

    async def load_lora_adapter_from_tensors(
        self,
        lora_name: str,
        config_dict: dict[str, Any],
        serialized_named_tensors: list[str],
        *,
        load_format: str | None = None,
        expected_checksums: dict[str, str] | None = None,
        upsert: bool = False,
    ) -> Any:
        """SGLang's route: a LoRA adapter from tensors (`serialized_named_tensors`, one payload
        per tensor-parallel rank); `expected_checksums` (SGLang's field): name -> sha256 of each
        tensor's bytes, checked by the engine on what it received; `upsert` (Miles's SGLang
        field, and the torch engine's; upstream SGLang ignores it) replaces a loaded adapter's
        weights in place."""
        body = _drop_none(
            {
                "lora_name": lora_name,
                "config_dict": config_dict,
                "serialized_named_tensors": serialized_named_tensors,
                "load_format": load_format,
                "expected_checksums": expected_checksums,
                "upsert": True if upsert else None,
            }
        )
        return await self.request("POST", "/load_lora_adapter_from_tensors", body)

    async def unload_lora_adapter(self, lora_name: str) -> Any:
        return await self.request("POST", "/unload_lora_adapter", {"lora_name": lora_name})

    async def update_weight_version(self, new_version: str, abort_all_requests: bool = False) -> Any:
        """SGLang's route: the weight_version reported from now on. SGLang aborts every request
        first unless told not to; the push has paused them to go on with the new version."""
        return await self.request(
            "POST",
            "/update_weight_version",
            {"new_version": new_version, "abort_all_requests": abort_all_requests},
        )

    async def update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        *,
        load_format: str | None = None,
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> Any:
        return await self._update(
            "/update_weights_from_tensor",
            _drop_none(
                {
                    "serialized_named_tensors": serialized_named_tensors,
                    "load_format": load_format,
                    "flush_cache": flush_cache,
                    "weight_version": weight_version,
                }
            ),
        )

    async def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str | None = None,
    ) -> Any:
        return await self.request(
            "POST",
            "/init_weights_update_group",
            _drop_none(
                {
                    "master_address": master_address,
                    "master_port": master_port,
                    "rank_offset": rank_offset,
                    "world_size": world_size,
                    "group_name": group_name,
                    "backend": backend,
                }
            ),
        )

    async def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> Any:
        return await self.request("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        *,
        flush_cache: bool = False,
        weight_version: str | None = None,
    ) -> Any:
        return await self._update(
            "/update_weights_from_distributed",
            _drop_none(
                {
                    "names": names,
                    "dtypes": dtypes,
                    "shapes": shapes,
                    "group_name": group_name,
                    "flush_cache": flush_cache,
                    "weight_version": weight_version,
                }
            ),
        )

    async def weights_checksum(self, names: list[str] | None = None) -> dict[str, Any]:
        """slime extension (torch engine): per-parameter sha256 fingerprints."""
        return await self.request("POST", "/slime/weights_checksum", _drop_none({"names": names}))

    async def weights_checker(self, action: str) -> dict[str, Any]:
        """SGLang's /weights_checker (snapshot, reset_tensors, compare); EngineError on failure."""
        return await self.request("POST", "/weights_checker", {"action": action})

    async def weights_fingerprint(self) -> dict[str, Any]:
        """slime extension (torch engine): dtype, shape and fingerprint of every parameter."""
        return await self.request("POST", "/slime/weights_fingerprint", {})

    async def dump_parameters(self, path: str) -> dict[str, Any]:
        """slime extension (torch engine): torch.save every parameter to path/<HF name>."""
        return await self.request("POST", "/slime/dump_parameters", {"path": path})

    async def release_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return await self.request("POST", "/release_memory_occupation", _drop_none({"tags": tags}))

    async def resume_memory_occupation(self, tags: list[str] | None = None) -> Any:
        return await self.request("POST", "/resume_memory_occupation", _drop_none({"tags": tags}))


async def _decode(resp: aiohttp.ClientResponse, url: str) -> Any:
    ctype = resp.headers.get("Content-Type", "")
    body: Any = await resp.json(content_type=None) if "json" in ctype else await resp.text()
    if resp.status >= 400:
        raise EngineError(f"HTTP {resp.status}: {_error_message(body)}", resp.status, url)
    return body


def _error_message(body: Any) -> Any:
    """The message of an error answer: {"success": false, "message"} (weight updates),
    {"error": {"message"}} or {"error": "..."} (SGLang's other routes), {"success": false,
    "error_message"} (its LoRA routes), {"message"} (ours), text."""
    if not isinstance(body, dict):
        return body
    if "message" in body:
        return body["message"]
    if body.get("error_message"):
        return body["error_message"]
    error = body.get("error")
    if isinstance(error, dict):
        return error.get("message", error)
    return error if error is not None else body


# Errors raised before a request could reach the server (ConnectionTimeoutError: aiohttp >= 3.10).
_NOT_CONNECTED: tuple[type[BaseException], ...] = tuple(
    t for t in (aiohttp.ClientConnectorError, getattr(aiohttp, "ConnectionTimeoutError", None)) if t
)


def _never_connected(error: aiohttp.ClientConnectionError) -> bool:
    """True when the request cannot have reached the engine: the connection never opened."""
    return isinstance(error, _NOT_CONNECTED)


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}
