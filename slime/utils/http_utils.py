"""`post` and `get` as slime's plugins call them (`from slime.utils.http_utils import post`):
async JSON requests to the engines, the router or any HTTP service.

`post(url, payload, max_retries=60, headers=None)` retries a failed request (no answer, a
timeout, an error status) once a second, and after the last attempt raises the last error, as
slime's does. A reply that is not JSON comes back as text.

On a cluster, slime's engines and the router it starts require the job's key (docs/cluster.md).
The rollout manager registers their addresses here (`register_credentials`), and a request to
one of those addresses carries the key, so slime's plugins post to
`http://{args.sglang_router_ip}:{args.sglang_router_port}/generate` unchanged. A request to any
other address carries only the headers the caller gives: the key never leaves for a third party.

Each call opens its own aiohttp session, so a call works from any event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from slime.utils.retry import RetryPolicy, retrying

__all__ = ["get", "post", "register_credentials"]

logger = logging.getLogger(__name__)

RETRY_INTERVAL_S = 1.0
TIMEOUT_S = 3600.0  # one request (a long generation may take minutes); the retries are on top


_credentials: dict[str, dict[str, str]] = {}  # "host:port" -> headers


def register_credentials(urls: list[str], api_key: str | None) -> None:
    """Requests to `urls` (the engines, the router) carry `Authorization: Bearer <api_key>`, and
    to no other address: the addresses registered before are forgotten (an engine replaced, a
    router restarted on another port). A None key registers nothing."""
    _credentials.clear()
    if api_key is None:
        return
    for url in urls:
        _credentials[_address(url)] = {"Authorization": f"Bearer {api_key}"}


def registered_api_key(url: str) -> str | None:
    """The key registered for `url`'s address (an engine or router of this job), else None."""
    known = _credentials.get(_address(url))
    return known["Authorization"].removeprefix("Bearer ") if known else None


def _address(url: str) -> str:
    from slime.utils.net import host_port

    host, port = host_port(url)
    return f"{host}:{port}"


def _headers(url: str, headers: dict[str, str] | None) -> dict[str, str] | None:
    known = _credentials.get(_address(url))
    if known is None or (headers and any(k.lower() == "authorization" for k in headers)):
        return headers
    return {**known, **(headers or {})}


def _decode(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return body.decode(errors="replace")


async def post(url: str, payload: Any, max_retries: int = 60, headers: dict[str, str] | None = None) -> Any:
    """POST `payload` as JSON to `url`; the reply's JSON (or its text)."""
    import aiohttp

    if max_retries < 1:
        raise ValueError(f"max_retries must be >= 1, got {max_retries}")
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    headers = _headers(url, headers)

    async def once() -> Any:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.post(url, json=payload or {}, headers=headers) as response,
        ):
            body = await response.read()
            if response.status >= 400:
                raise aiohttp.ClientResponseError(
                    response.request_info,
                    (),
                    status=response.status,
                    message=body.decode(errors="replace")[:500],
                )
            return _decode(body)

    def retryable(e: BaseException) -> bool:  # no answer, a timeout, an error status
        return isinstance(e, (aiohttp.ClientError, asyncio.TimeoutError))

    def on_retry(failures: int, e: BaseException, wait: float) -> None:
        logger.info("POST %s: %s; retrying (%d/%d)", url, e, failures, max_retries)

    policy = RetryPolicy(max_retries, RETRY_INTERVAL_S, multiplier=1.0)  # slime's: once a second
    try:
        return await retrying(once, policy, retryable, on_retry)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        logger.warning("POST %s failed %d times; the last error: %s", url, max_retries, e)
        raise


async def get(url: str, headers: dict[str, str] | None = None) -> Any:
    """GET `url`; the reply's JSON (or its text). An error status raises."""
    import aiohttp

    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=TIMEOUT_S)) as session,
        session.get(url, headers=_headers(url, headers)) as response,
    ):
        response.raise_for_status()
        return _decode(await response.read())
