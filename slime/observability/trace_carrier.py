"""A per-sample trace as a dump holds it: the carrier dict on `Sample.trace`, the handles that
point into it, and the events written there (the layout: slime.observability.trace_utils). The
recording API (spans, events, functions, the current span) is trace_utils'; this module is what
it writes and what a trace continued elsewhere binds to."""

from __future__ import annotations

import enum
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from slime.utils.sample import Sample

logger = logging.getLogger(__name__)


TRACE_VERSION = 1


TRACE_CHILDREN_KEY = "_trace_children"
"""slime's key for synthetic child spans in end attrs (PD timings); dropped here."""


SGLANG_TRACE_META_KEYS = (
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "queue_time",
    "e2e_latency",
    "decode_throughput",
)
"""The /generate meta_info fields a `sglang_generate` span ends with."""


@dataclass
class TraceHandle:
    """Where a trace's events go (`carrier`, usually a sample's `trace`) and the ids they carry.
    `parent_span_id`: the span the outermost span or event opened with it nests under (set by
    `import_trace` when a trace continues in another context)."""

    trace_id: str
    carrier: dict[str, Any]
    sample_id: int | str | None = None
    group_id: int | str | None = None
    attempt: int = 0
    parent_span_id: str | None = None


def _log_trace_error(action: str, exc: BaseException) -> None:
    logger.debug("trace %s skipped: %s", action, exc, exc_info=True)


def _new_id() -> str:
    return uuid.uuid4().hex


def _plain(value: Any) -> Any:
    """`value` as numbers, strings, lists and dicts only (what weights_only=True loads)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    item = getattr(value, "item", None)  # numpy and torch scalars (np.float64 subclasses float)
    if callable(item):
        try:
            return _plain(item())
        except Exception:
            pass
    return str(value)


def build_sglang_meta_trace_attrs(meta: dict[str, Any]) -> dict[str, Any]:
    """The end attrs of a `sglang_generate` span from the answer's meta_info: SGLang's token
    counts and timings (`SGLANG_TRACE_META_KEYS`), `finish_reason` (its type) and
    `sglang_request_id` (meta_info's `id`)."""
    attrs: dict[str, Any] = {}
    try:
        attrs.update({k: meta[k] for k in SGLANG_TRACE_META_KEYS if meta.get(k) is not None})
        finish = meta.get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") is not None:
            attrs["finish_reason"] = finish["type"]
        elif finish is not None:
            attrs["finish_reason"] = finish
        if meta.get("id") is not None:
            attrs["sglang_request_id"] = meta["id"]
    except Exception as exc:
        _log_trace_error("sglang_meta_attrs", exc)
    return attrs


def _ensure_trace_carrier(
    carrier: dict[str, Any] | None,
    *,
    trace_id: str | None = None,
    sample_id: int | str | None = None,
    group_id: int | str | None = None,
    attempt: int = 0,
) -> dict[str, Any]:
    carrier = {} if carrier is None else carrier
    carrier.setdefault("version", TRACE_VERSION)
    carrier.setdefault("trace_id", trace_id or _new_id())
    carrier.setdefault("events", [])
    for key, value in (("sample_id", sample_id), ("group_id", group_id)):
        carrier[key] = value if value is not None else carrier.get(key)
    carrier["attempt"] = int(carrier.get("attempt", attempt))
    return carrier


def _handle(carrier: dict[str, Any], parent_span_id: str | None = None) -> TraceHandle:
    ids = carrier.get("sample_id"), carrier.get("group_id"), int(carrier.get("attempt", 0))
    return TraceHandle(carrier["trace_id"], carrier, *ids, parent_span_id)


def _noop_handle(parent_span_id: str | None = None) -> TraceHandle:
    """Where events go when a trace cannot be bound: a carrier nothing keeps."""
    carrier = {"version": TRACE_VERSION, "trace_id": "", "events": [], "sample_id": None, "group_id": None}
    return _handle({**carrier, "attempt": 0}, parent_span_id)


def bind_trace(sample: Sample) -> TraceHandle:
    """The handle of `sample`'s trace, creating the trace on it if it has none."""
    try:
        sample.trace = _ensure_trace_carrier(
            getattr(sample, "trace", None), sample_id=sample.index, group_id=sample.group_index
        )
        return _handle(sample.trace)
    except Exception as exc:
        _log_trace_error("bind", exc)
        return _noop_handle()


def bind_trace_carrier(
    carrier: dict[str, Any] | None,
    *,
    trace_id: str | None = None,
    sample_id: int | str | None = None,
    group_id: int | str | None = None,
    attempt: int = 0,
    parent_span_id: str | None = None,
) -> TraceHandle:
    """A handle on `carrier` (a new trace dict when None), filled in with these ids."""
    try:
        trace = _ensure_trace_carrier(
            carrier, trace_id=trace_id, sample_id=sample_id, group_id=group_id, attempt=attempt
        )
        return _handle(trace, parent_span_id)
    except Exception as exc:
        _log_trace_error("bind_carrier", exc)
        return _noop_handle(parent_span_id)


def import_trace(payload: dict[str, Any], carrier: dict[str, Any] | None = None) -> TraceHandle:
    """A handle from `export_trace`'s payload, recording into `carrier` (the sample's own trace
    when it is at hand, else a new dict the caller keeps)."""
    try:
        return bind_trace_carrier(
            carrier,
            trace_id=payload.get("trace_id"),
            sample_id=payload.get("sample_id"),
            group_id=payload.get("group_id"),
            attempt=int(payload.get("attempt", 0)),
            parent_span_id=payload.get("parent_span_id"),
        )
    except Exception as exc:
        _log_trace_error("import", exc)
        return _noop_handle()


def _coerce_handles(target: Any) -> list[TraceHandle]:
    if isinstance(target, TraceHandle):
        return [target]
    if isinstance(target, Sample):
        return [bind_trace(target)]
    if isinstance(target, list):
        return [h for item in target for h in _coerce_handles(item)]
    return []


def _append_event(
    handle: TraceHandle,
    kind: str,
    name: str,
    timestamp: float,
    attrs: dict[str, Any] | None,
    span_id: str | None = None,
    parent_span_id: str | None = None,
) -> dict[str, Any]:
    event: dict[str, Any] = {
        "type": kind,
        "name": name,
        "ts": timestamp,
        "trace_id": handle.trace_id,
        "sample_id": handle.sample_id,
        "group_id": handle.group_id,
        "attempt": int(handle.carrier.get("attempt", handle.attempt)),
    }
    if span_id is not None:
        event["span_id"] = span_id
    if parent_span_id is not None:
        event["parent_span_id"] = parent_span_id
    if attrs:
        event["attrs"] = {str(k): _plain(v) for k, v in attrs.items() if k != TRACE_CHILDREN_KEY}
    handle.carrier["events"].append(event)
    return event
