"""Per-sample execution traces: spans and instant events recorded on a sample, at slime's path
and with slime's names, so a plugin's `from slime.observability.trace_utils import ...` works and
a dump's traces read the same in either project (and in slime's timeline viewer).

A trace is a plain dict on `Sample.trace` (the "carrier"), saved with the sample:

    {"version": 1, "trace_id": hex, "sample_id": index, "group_id": group_index, "attempt": 0,
     "events": [{"type": "span_start" | "span_end" | "event", "name": str,
                 "ts": time.time() seconds, "trace_id", "sample_id", "group_id", "attempt",
                 "span_id": hex (spans), "parent_span_id": hex (starts and events, when nested),
                 "attrs": {...} (when there are any)}, ...]}

A span is a `span_start` and a `span_end` with one `span_id`; the start carries the attrs given
when it opened, the end those set while it ran (`span.update(...)`), plus `error_type` and
`error_message` when its block raised. `sample_id` / `group_id` are the sample's numbers when the
trace was last bound to it, and each event carries those of its own time, as slime's do (in the
built-in rollout: the draw order while it generates, the final numbers once the kept groups are
numbered again). Attr values are stored as plain values (numbers, strings, lists, dicts; anything else as
its `item()` or `str`), so a dump still loads with `torch.load(weights_only=True)`.

The current span of each trace lives in a contextvar, so spans nest across `await` and the tasks
`asyncio.gather` starts. Tracing never raises into the code it traces: a failure to record is
logged at debug level and skipped, as in slime.

Left out of slime's module: the synthetic child spans built from SGLang's prefill/decode
disaggregation timings (`_trace_children` in the end attrs; no PD serving here, and the key is
dropped when given) and its `SampleBox` targets. Differs from slime: a span opened inside another
span of the same trace nests under it even when the handle carries a parent from `import_trace`
(there the handle's parent applies to the outermost span; slime lets it win everywhere); a
cancelled block ends its span too (`error_type` "CancelledError"; slime leaves it open); and
`trace_span` always yields a `TraceSpanContext`, a no-op one when nothing is traced.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from slime.observability.trace_carrier import (  # slime's names, importable from here
    SGLANG_TRACE_META_KEYS,
    TRACE_CHILDREN_KEY,
    TRACE_VERSION,
    TraceHandle,
    _append_event,
    _coerce_handles,
    _log_trace_error,
    _new_id,
    _noop_handle,
    _plain,
    bind_trace,
    bind_trace_carrier,
    build_sglang_meta_trace_attrs,
    import_trace,
)
from slime.utils.sample import Sample

__all__ = [
    "SGLANG_TRACE_META_KEYS",
    "TRACE_CHILDREN_KEY",
    "TRACE_VERSION",
    "TraceHandle",
    "TraceSpanContext",
    "bind_trace",
    "bind_trace_carrier",
    "build_sglang_meta_trace_attrs",
    "export_trace",
    "import_trace",
    "trace_event",
    "trace_function",
    "trace_next_attempt",
    "trace_span",
]

logger = logging.getLogger(__name__)


_Frame = tuple[tuple[TraceHandle, str], ...]  # one open span: its (handle, span id) pairs
_STACK: contextvars.ContextVar[tuple[_Frame, ...]] = contextvars.ContextVar("slime_trace_stack", default=())


@dataclass
class TraceSpanContext:
    """What `trace_span` yields: `set`/`update` add attrs to the span's end (also after it has
    ended: the recorded ends follow)."""

    target: Any = None
    handles: list[TraceHandle] = field(default_factory=list)
    span_records: list[tuple[TraceHandle, str]] = field(default_factory=list)
    start_ts: float = 0.0
    end_attrs: dict[str, Any] = field(default_factory=dict)
    end_events: list[dict[str, Any]] = field(default_factory=list)
    closed: bool = False

    def set(self, key: str, value: Any) -> TraceSpanContext:
        return self.update({key: value})

    def update(self, attrs: dict[str, Any] | None) -> TraceSpanContext:
        try:
            if attrs:
                plain = {str(k): _plain(v) for k, v in attrs.items() if k != TRACE_CHILDREN_KEY}
                self.end_attrs.update(plain)
                for event in self.end_events:
                    event.setdefault("attrs", {}).update(plain)
        except Exception as exc:
            _log_trace_error("update", exc)
        return self

    set_attr = set  # slime's other names for them
    update_attrs = update

    def build_end_attrs(self) -> dict[str, Any] | None:
        return dict(self.end_attrs) or None


# --- carriers and handles -------------------------------------------------------------------


def export_trace(handle: TraceHandle) -> dict[str, Any]:
    """The ids a trace continues with in another task, thread or process: `import_trace` there
    gives a handle whose spans nest under the span open here now."""
    try:
        parent = _parent_span_id(handle, _STACK.get())
    except Exception as exc:
        _log_trace_error("export", exc)
        handle, parent = _noop_handle(), None
    return {
        "version": TRACE_VERSION,
        "trace_id": handle.trace_id,
        "sample_id": handle.sample_id,
        "group_id": handle.group_id,
        "attempt": handle.attempt,
        "parent_span_id": parent,
    }


def _parent_span_id(handle: TraceHandle, stack: tuple[_Frame, ...]) -> str | None:
    """The innermost open span of `handle`'s trace in this context, else the handle's parent."""
    for frame in reversed(stack):
        for open_handle, span_id in frame:
            if open_handle.trace_id == handle.trace_id:
                return span_id
    return handle.parent_span_id


# --- recording ------------------------------------------------------------------------------


def trace_event(target: Any, name: str, *, attrs: dict[str, Any] | None = None) -> None:
    """An instant event on each trace of `target` (a Sample, a TraceHandle or a list of them)."""
    try:
        timestamp, stack = time.time(), _STACK.get()
        for handle in _coerce_handles(target):
            _append_event(handle, "event", name, timestamp, attrs, None, _parent_span_id(handle, stack))
    except Exception as exc:
        _log_trace_error(f"event:{name}", exc)


def _start_span(span: TraceSpanContext, name: str, attrs: dict[str, Any] | None) -> contextvars.Token | None:
    span.handles = _coerce_handles(span.target)
    if not span.handles:
        return None
    span.start_ts = time.time()
    stack = _STACK.get()
    for handle in span.handles:
        span_id = _new_id()
        _append_event(
            handle, "span_start", name, span.start_ts, attrs, span_id, _parent_span_id(handle, stack)
        )
        span.span_records.append((handle, span_id))
    return _STACK.set((*stack, tuple(span.span_records)))


def _end_span(span: TraceSpanContext, name: str, error: BaseException | None) -> None:
    try:
        attrs = dict(span.end_attrs)
        if error is not None:
            attrs.update(error_type=type(error).__name__, error_message=str(error))
        timestamp = time.time()
        span.end_events = [
            _append_event(handle, "span_end", name, timestamp, attrs, span_id)
            for handle, span_id in span.span_records
        ]
        span.closed = True
    except Exception as exc:
        _log_trace_error(f"span_end:{name}", exc)


@contextmanager
def trace_span(
    target: Any, name: str, *, attrs: dict[str, Any] | None = None, record_error: bool = True
) -> Iterator[TraceSpanContext]:
    """A span named `name` on each trace of `target` (a Sample, a TraceHandle or a list of them)
    around the block: `attrs` at its start, what the block `update`s at its end. An exception in
    the block ends the span (with `error_type` / `error_message` when `record_error`) and goes on."""
    span = TraceSpanContext(target=target)
    token = None
    try:
        token = _start_span(span, name, attrs)
    except Exception as exc:
        _log_trace_error(f"span:{name}", exc)
    try:
        yield span
    except BaseException as exc:
        if span.span_records:
            _end_span(span, name, exc if record_error else None)
        raise
    else:
        if span.span_records:
            _end_span(span, name, None)
    finally:
        if token is not None:
            try:
                _STACK.reset(token)
            except Exception as exc:  # the block moved to another context (a generator resumed elsewhere)
                _log_trace_error(f"span_reset:{name}", exc)


def trace_next_attempt(target: Any, *, attrs: dict[str, Any] | None = None) -> Any:
    """Count a retry on each trace of `target`: its `attempt` goes up by one, an `attempt_start`
    event marks it, and later events carry the new number. Returns the handle(s)."""
    try:
        handles = _coerce_handles(target)
        for handle in handles:
            handle.attempt = handle.carrier["attempt"] = int(handle.carrier.get("attempt", 0)) + 1
            trace_event(handle, "attempt_start", attrs={"attempt": handle.attempt, **(attrs or {})})
        if not handles:
            return target
        return handles[0] if len(handles) == 1 else handles
    except Exception as exc:
        _log_trace_error("next_attempt", exc)
        return target


# --- the decorator ------------------------------------------------------------------------


def _traceable(value: Any) -> Any:
    """`value` when it is a trace target (a Sample, a TraceHandle, a non-empty list of them)."""
    if isinstance(value, Sample | TraceHandle):
        return value
    if isinstance(value, list) and value and all(_traceable(v) is not None for v in value):
        return value
    return None


def _current_target() -> Any:
    stack = _STACK.get()
    if not stack or not stack[-1]:
        return None
    handles = [handle for handle, _ in stack[-1]]
    return handles[0] if len(handles) == 1 else handles


@dataclass
class _Resolver:
    """How `trace_function` finds one call's target and start attrs (see its docstring)."""

    name: str
    fn: Callable[..., Any]
    target: str | None
    target_getter: Callable[..., Any] | None
    attrs_getter: Callable[..., dict[str, Any] | None] | None
    inferred: bool = False  # warned once that the target was inferred
    qualname: str = field(init=False)
    signature: inspect.Signature | None = field(init=False)

    def __post_init__(self) -> None:
        self.qualname = getattr(self.fn, "__qualname__", repr(self.fn))
        try:
            self.signature = inspect.signature(self.fn)
        except (TypeError, ValueError):
            self.signature = None

    def __call__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
        try:
            found = self._target(args, kwargs)
        except Exception as exc:
            _log_trace_error(f"trace_function_target:{self.qualname}", exc)
            return None, None
        if found is None or self.attrs_getter is None:
            return found, None
        try:
            attrs = self.attrs_getter(*args, **kwargs)
        except Exception as exc:  # traced without start attrs, as slime does
            _log_trace_error(f"trace_function_attrs:{self.qualname}", exc)
            return found, None
        if attrs is not None and not isinstance(attrs, dict):
            logger.warning("trace_function %r: attrs_getter returned a %s; ignored", self.name, type(attrs))
            return found, None
        return found, attrs

    def _target(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.target is None and self.target_getter is not None:
            return _traceable(self.target_getter(*args, **kwargs))
        bound = self.signature.bind_partial(*args, **kwargs).arguments if self.signature else None
        if self.target is not None:
            found = _traceable((bound or kwargs).get(self.target))
            if found is None:
                logger.warning(
                    "trace_function %r: %s(%s=) is no trace target; untraced",
                    self.name,
                    self.qualname,
                    self.target,
                )
            return found
        values = list(bound.values()) if bound is not None else [*args, *kwargs.values()]
        found = next((v for v in map(_traceable, values) if v is not None), None)
        if found is not None and not self.inferred:
            self.inferred = True
            logger.warning(
                "trace_function %r inferred its target from the arguments of %s: name it with target=",
                self.name,
                self.qualname,
            )
        return found if found is not None else _current_target()


def trace_function(
    name: str,
    *,
    target: str | None = None,
    target_getter: Callable[..., Any] | None = None,
    attrs_getter: Callable[..., dict[str, Any] | None] | None = None,
    record_error: bool = True,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap a sync or async function in a span named `name`.

    Args:
        target: the parameter holding the trace target (a Sample, a TraceHandle, a list of them).
        target_getter: called with the function's arguments, returns the target.
        attrs_getter: called with the function's arguments, returns the span's start attrs.
        record_error: an exception's type and message go into the span's end attrs.

    With neither `target` nor `target_getter`, the first traceable argument is taken (warned once
    per function: prefer naming it), else the innermost open span's traces. No target found:
    the call runs untraced.
    """

    def decorator(fn: Callable[..., Any]) -> Callable[..., Any]:
        resolve = _Resolver(name, fn, target, target_getter, attrs_getter)
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                found, attrs = resolve(args, kwargs)
                if found is None:
                    return await fn(*args, **kwargs)
                with trace_span(found, name, attrs=attrs, record_error=record_error):
                    return await fn(*args, **kwargs)

            return async_wrapper

        @functools.wraps(fn)
        def sync_wrapper(*args: Any, **kwargs: Any) -> Any:
            found, attrs = resolve(args, kwargs)
            if found is None:
                return fn(*args, **kwargs)
            with trace_span(found, name, attrs=attrs, record_error=record_error):
                return fn(*args, **kwargs)

        return sync_wrapper

    return decorator
