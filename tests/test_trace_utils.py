"""Per-sample traces (slime.observability.trace_utils): slime's payload layout, spans nesting
across tasks and threads, attrs at a span's start and end, errors ending a span, and tracing
that never raises into the code it traces."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from slime.observability.trace_utils import (
    TRACE_CHILDREN_KEY,
    TRACE_VERSION,
    TraceHandle,
    bind_trace,
    build_sglang_meta_trace_attrs,
    export_trace,
    import_trace,
    trace_event,
    trace_function,
    trace_next_attempt,
    trace_span,
)
from slime.utils.sample import Sample

EVENT_KEYS = {"type", "name", "ts", "trace_id", "sample_id", "group_id", "attempt"}


def spans(sample):
    """name -> (start event, end event or None), for names that occur once."""
    starts = {e["span_id"]: e for e in sample.trace["events"] if e["type"] == "span_start"}
    ends = {e["span_id"]: e for e in sample.trace["events"] if e["type"] == "span_end"}
    return {s["name"]: (s, ends.get(i)) for i, s in starts.items()}


def test_spans_nest_with_parents_and_carry_slimes_layout():
    s = Sample(index=7, group_index=2)
    with trace_span(s, "outer", attrs={"k": 1}) as outer:
        with trace_span(s, "inner") as inner:
            inner.update({"tokens": 3})
            trace_event(s, "tick", attrs={"n": 1})
        outer.set("done", True)
    trace = s.trace
    assert set(trace) == {"version", "trace_id", "events", "sample_id", "group_id", "attempt"}
    assert (trace["version"], trace["sample_id"], trace["group_id"], trace["attempt"]) == (
        TRACE_VERSION,
        7,
        2,
        0,
    )
    kinds = [(e["type"], e["name"]) for e in trace["events"]]
    assert kinds == [
        ("span_start", "outer"),
        ("span_start", "inner"),
        ("event", "tick"),
        ("span_end", "inner"),
        ("span_end", "outer"),
    ]
    assert all(set(e) >= EVENT_KEYS and e["trace_id"] == trace["trace_id"] for e in trace["events"])
    got = spans(s)
    (o_start, o_end), (i_start, i_end) = got["outer"], got["inner"]
    assert "parent_span_id" not in o_start and i_start["parent_span_id"] == o_start["span_id"]
    assert trace["events"][2]["parent_span_id"] == i_start["span_id"] and "span_id" not in trace["events"][2]
    assert o_start["attrs"] == {"k": 1} and o_end["attrs"] == {"done": True}
    assert "attrs" not in i_start and i_end["attrs"] == {"tokens": 3}
    assert o_start["ts"] <= i_start["ts"] <= i_end["ts"] <= o_end["ts"]
    outer.set("late", 1)  # after the end: the recorded end follows
    assert o_end["attrs"] == {"done": True, "late": 1}


def test_a_group_span_records_into_each_sample_and_tasks_nest_under_it():
    group = [Sample(index=i) for i in range(3)]

    async def one(s):
        with trace_span(s, "generate"):
            await asyncio.sleep(0)

    async def run():
        with trace_span(group, "group", attrs={"group_size": 3}):
            await asyncio.gather(*(one(s) for s in group))

    asyncio.run(run())
    assert len({s.trace["trace_id"] for s in group}) == 3
    for s in group:
        (g_start, g_end), (start, end) = spans(s)["group"], spans(s)["generate"]
        assert g_start["attrs"] == {"group_size": 3} and g_end is not None and end is not None
        assert start["parent_span_id"] == g_start["span_id"]  # its own trace's group span


def test_trace_function_async_and_sync_with_targets_and_attrs():
    @trace_function("gen_rm", target="sample", attrs_getter=lambda args, sample, params: {"n": params["n"]})
    async def gen_rm(args, sample, params):
        await asyncio.sleep(0)
        return helper(sample)

    @trace_function("helper")  # no target: inferred from the arguments (warned once)
    def helper(sample):
        return trace_inside()

    @trace_function("inside")  # nothing traceable in its arguments: the open span's trace
    def trace_inside():
        return "ok"

    s = Sample()
    assert asyncio.run(gen_rm(None, s, {"n": 4})) == "ok"
    got = spans(s)
    assert got["gen_rm"][0]["attrs"] == {"n": 4} and gen_rm.__name__ == "gen_rm"
    assert got["helper"][0]["parent_span_id"] == got["gen_rm"][0]["span_id"]
    assert got["inside"][0]["parent_span_id"] == got["helper"][0]["span_id"]
    assert all(end is not None for _, end in got.values())
    assert trace_inside() == "ok"  # outside any span: runs untraced


def test_an_exception_ends_the_span_and_goes_on():
    s = Sample()

    @trace_function("fails", target="sample")
    async def fails(sample):
        raise KeyError("boom")

    with pytest.raises(KeyError):
        asyncio.run(fails(s))
    with pytest.raises(ValueError), trace_span(s, "quiet", record_error=False):
        raise ValueError("x")
    got = spans(s)
    assert got["fails"][1]["attrs"] == {"error_type": "KeyError", "error_message": "'boom'"}
    assert "attrs" not in got["quiet"][1]

    async def cancelled():
        with trace_span(s, "cancelled"):
            await asyncio.sleep(10)

    async def run():
        task = asyncio.create_task(cancelled())
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(run())
    assert spans(s)["cancelled"][1]["attrs"]["error_type"] == "CancelledError"


def test_tracing_never_raises_into_the_code_it_traces(caplog):
    broken = Sample()
    broken.trace = "not a dict"  # binding fails: the events go nowhere

    def bad_getter(*args):
        raise RuntimeError("getter")

    @trace_function("t", target_getter=bad_getter, attrs_getter=bad_getter)
    def traced(x):
        return x + 1

    @trace_function("missing", target="nope")
    def no_such_argument(sample):
        return 2

    @trace_function("no_attrs", target="sample", attrs_getter=bad_getter)
    def attrs_fail(sample):
        return 3

    with trace_span(broken, "span") as span:
        span.update({"a": 1}).update("not a dict")  # type: ignore[arg-type]
    trace_event(broken, "e")
    with trace_span(None, "nothing") as span:  # nothing to trace: a no-op span
        span.set("k", 1)
    assert traced(1) == 2 and no_such_argument(Sample()) == 2 and broken.trace == "not a dict"
    s = Sample()
    assert attrs_fail(s) == 3 and "attrs" not in spans(s)["no_attrs"][0]  # traced, without start attrs
    assert "is no trace target" in caplog.text


def test_attrs_are_stored_as_plain_values():
    s = Sample()
    with trace_span(s, "x", attrs={"np": np.float64(0.5), "status": Sample.Status.COMPLETED}) as span:
        span.update({"obj": object, "nested": {1: (np.int64(2),)}, TRACE_CHILDREN_KEY: [{"type": "span"}]})
    start, end = spans(s)["x"]
    assert start["attrs"] == {"np": 0.5, "status": "completed"} and type(start["attrs"]["np"]) is float
    assert end["attrs"] == {"obj": str(object), "nested": {"1": [2]}}  # slime's PD children: dropped


def test_build_sglang_meta_trace_attrs():
    meta = {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "cached_tokens": 0,
        "queue_time": 0.01,
        "e2e_latency": 0.2,
        "decode_throughput": 50.0,
        "finish_reason": {"type": "length", "length": 2},
        "id": "rid-1",
        "weight_version": "3",
        "pd_prefill_forward_duration": 0.1,
    }
    assert build_sglang_meta_trace_attrs(meta) == {
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "cached_tokens": 0,
        "queue_time": 0.01,
        "e2e_latency": 0.2,
        "decode_throughput": 50.0,
        "finish_reason": "length",
        "sglang_request_id": "rid-1",
    }
    assert build_sglang_meta_trace_attrs({"finish_reason": "stop", "queue_time": None}) == {
        "finish_reason": "stop"
    }
    assert build_sglang_meta_trace_attrs(None) == {}  # type: ignore[arg-type]


def test_export_and_import_continue_a_trace_in_another_thread():
    s = Sample(index=1)
    with trace_span(s, "rollout") as parent:
        payload = export_trace(bind_trace(s))

    def elsewhere():
        handle = import_trace(payload, s.trace)
        with trace_span(handle, "turn"), trace_span(handle, "engine"):
            pass
        trace_event(handle, "after")

    thread = threading.Thread(target=elsewhere)
    thread.start()
    thread.join()
    rollout_id = parent.span_records[0][1]
    assert payload["parent_span_id"] == rollout_id and payload["trace_id"] == s.trace["trace_id"]
    got = spans(s)
    assert got["turn"][0]["parent_span_id"] == rollout_id
    assert got["engine"][0]["parent_span_id"] == got["turn"][0]["span_id"]  # the stack wins inside
    assert s.trace["events"][-1]["parent_span_id"] == rollout_id
    fresh = import_trace(payload)  # no carrier: a new one the caller keeps
    assert isinstance(fresh, TraceHandle) and fresh.carrier["trace_id"] == payload["trace_id"]


def test_next_attempt_numbers_later_events():
    s = Sample()
    with trace_span(s, "first"):
        pass
    handle = trace_next_attempt(s, attrs={"why": "engine down"})
    with trace_span(handle, "second"):
        pass
    events = s.trace["events"]
    assert [e["attempt"] for e in events] == [0, 0, 1, 1, 1] and s.trace["attempt"] == 1
    assert events[2]["name"] == "attempt_start" and events[2]["attrs"] == {"attempt": 1, "why": "engine down"}
