"""A turn's /generate: the engine's sampling parameters for it, the call, its TurnRecord."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from typing import Any, Protocol

from slime.agent.adapters.errors import AdapterError
from slime.agent.trajectory import TurnRecord
from slime.observability.trace_utils import TraceHandle, build_sglang_meta_trace_attrs, trace_span


class Session(Protocol):
    """What a turn reads of its session (slime.agent.adapters.common.Session)."""

    sampling_defaults: dict[str, Any]
    ignored_sampling: set[str]
    max_context_tokens: int
    engine_url: str | None
    trace: TraceHandle | None


class Adapter(Protocol):
    """What a turn reads of its adapter (slime.agent.adapters.common.BaseAdapter): named here, not
    imported, so this module sits below the adapters that call it."""

    max_token_keys: tuple[str, ...]
    stop_keys: tuple[str, ...]
    logger: logging.Logger
    log_prefix: str
    sglang_url: str

    def _client(self, url: str) -> Any: ...


DEFAULT_MAX_NEW_TOKENS = 4096
"""slime's: a turn's budget when neither the session nor the request gives one."""


def sampling_params(
    session: Session, body: dict[str, Any], max_token_keys: tuple[str, ...], stop_keys: tuple[str, ...]
) -> dict[str, Any]:
    """The engine's sampling_params: the session's defaults (the rollout's), a request's
    max-tokens as a cap below them, its stop sequences, and its temperature / top_p / top_k where
    the session sets none. Where it does, the session's stay (slime takes the request's): the
    trainer computes log-probs at the rollout's temperature, and an agent's own would make them
    silently wrong; the session notes the values it kept out (`ignored_sampling`)."""
    params: dict[str, Any] = {
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
        "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
        **session.sampling_defaults,
    }
    for key in max_token_keys:
        if body.get(key) is not None:
            params["max_new_tokens"] = min(int(params["max_new_tokens"]), check_int(body, key))
            break
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is None:
            continue
        if key not in session.sampling_defaults:
            params[key] = body[key]
        elif body[key] != session.sampling_defaults[key]:
            session.ignored_sampling.add(key)
    for key in stop_keys:
        if body.get(key):
            params["stop"] = body[key]
            break
    return params


def check_int(body: dict[str, Any], key: str) -> int:
    value = body[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise AdapterError(400, f"'{key}' must be an integer >= 0, got {value!r}")
    return value


async def call_sglang_generate(
    prompt_ids: list[int],
    session: Session,
    body: dict[str, Any],
    *,
    adapter: Adapter,
    session_id: str | None = None,
    image_data: list[str] | None = None,
) -> TurnRecord:
    """One /generate of a turn (module-level, as slime's, so a test can replace it). A prompt
    over the session's context budget generates nothing and ends with finish_reason "length"."""
    from slime.engines.client import EngineError

    params = sampling_params(session, body, adapter.max_token_keys, adapter.stop_keys)
    if session.max_context_tokens > 0:
        room = session.max_context_tokens - len(prompt_ids)
        if room <= 0:
            adapter.logger.warning(
                "[%s] session %s: the prompt (%d tokens) fills max_context_tokens %d",
                adapter.log_prefix,
                session_id,
                len(prompt_ids),
                session.max_context_tokens,
            )
            return TurnRecord(list(prompt_ids), [], "length")
        params["max_new_tokens"] = min(int(params["max_new_tokens"]), room)
    client = adapter._client(session.engine_url or adapter.sglang_url)
    rid = uuid.uuid4().hex
    # slime's routing key: a router keeps a session's turns on one engine (its prefix cache).
    headers = {"X-SMG-Routing-Key": session_id} if session_id and session_id != "default" else None
    payload: dict[str, Any] = {
        "rid": rid,
        "input_ids": list(prompt_ids),
        "sampling_params": params,
        "return_logprob": True,
    }
    if image_data:  # a vision-language prompt: its images, their tokens in the ids (SGLang's field)
        payload["image_data"] = image_data
    with trace_span(
        session.trace, "sglang_generate", attrs={"max_new_tokens": params["max_new_tokens"]}
    ) as span:
        try:
            out = await client.request("POST", "/generate", payload, headers=headers)
        except EngineError as e:  # the engine may still be generating it (a timeout): free its slot
            _abort_soon(client, rid)
            status = 400 if e.status is not None and 400 <= e.status < 500 else 502
            raise AdapterError(status, f"the engine refused or failed the turn: {e}", "api_error") from None
        except asyncio.CancelledError:  # the client left or the session was shut down: free the engine's slot
            _abort_soon(client, rid)
            raise
        meta = out.get("meta_info") or {}
        span.update(build_sglang_meta_trace_attrs(meta))
    ran = meta.get("prompt_tokens")
    if image_data and ran is not None and int(ran) != len(prompt_ids):  # images expanded another way
        raise AdapterError(
            502,
            f"session {session_id}: the engine ran {ran} prompt tokens for the {len(prompt_ids)} sent "
            "with the turn's images: it expanded the image placeholders another way than the "
            "checkpoint's processor (the trainer would see other ids)",
            "api_error",
        )
    pairs = meta.get("output_token_logprobs") or []
    ids = [int(p[1]) for p in pairs] if pairs else [int(t) for t in out.get("output_ids", [])]
    return TurnRecord(
        prompt_ids=list(prompt_ids),
        output_ids=ids,
        finish_reason=str((meta.get("finish_reason") or {}).get("type") or "stop"),
        output_log_probs=[float(p[0]) for p in pairs],
        weight_versions=_token_versions(meta, len(ids)),
    )


def _token_versions(meta: dict[str, Any], n: int) -> list[str | None]:
    spans = meta.get("weight_version_spans")
    if spans and sum(int(c) for _, c in spans) == n:
        return [None if v is None else str(v) for v, c in spans for _ in range(int(c))]
    version = meta.get("weight_version")
    return [None if version is None else str(version)] * n


_ABORTS: set[asyncio.Future[None]] = set()


def _abort_soon(client: Any, rid: str) -> None:
    aborting = asyncio.ensure_future(_abort(client, rid))
    _ABORTS.add(aborting)
    aborting.add_done_callback(_ABORTS.discard)


async def _abort(client: Any, rid: str) -> None:
    with contextlib.suppress(Exception):  # the engine may be gone too; its own timeout frees the slot then
        await client.abort_request(rid)
