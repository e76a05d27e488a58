"""The job's timeline (--trace-dir): the recorder every process has, the trace file the driver
writes and its "where the time went" table, an engine's events over real HTTP, the exit-2 check,
and the trace of real jobs parsed back (every process present, spans nested, clocks monotone)."""

from __future__ import annotations

import itertools
import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from slime.engines.protocol import new_api_key
from slime.observability.timeline import (
    TimeAccount,
    TraceFile,
    estimate_offset,
    intersect,
    length,
    trace_dir_problem,
    union,
)
from slime.utils.job_trace import ENV, Recorder, StateRow

MS = 1_000_000


def test_an_idle_recorder_records_nothing():
    r = Recorder()
    with r.span("phase"):
        r.instant("retry")
        r.counter("requests", {"running": 1})
        r.complete("x", 0, 10)
    assert r.drain() == []


def test_spans_nest_in_time_and_a_failed_block_says_why():
    r = Recorder()
    r.enable()
    with r.span("outer", "loop", rollout_id=3):
        with r.span("inner", "loop"):
            pass
        with pytest.raises(ValueError), r.span("failing", "loop"):
            raise ValueError("bad batch")
    r.instant("engine down", track="health checks", url="http://x")
    inner, failing, outer, down = r.drain()
    assert [e["name"] for e in (inner, failing, outer)] == [
        "inner",
        "failing",
        "outer",
    ]  # recorded as they end
    for e in (inner, failing):
        assert outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"]
    assert inner["ts"] + inner["dur"] <= failing["ts"]
    assert failing["args"] == {"error": "ValueError: bad batch"} and outer["args"] == {"rollout_id": 3}
    assert outer["tid"] == "loop" and "track" not in outer
    assert down["ph"] == "i" and down["track"] == "health checks" and down["args"] == {"url": "http://x"}
    assert r.drain() == []  # each event is given out once


def test_counters_are_thinned_but_idle_is_exact():
    r = Recorder()
    r.enable()
    big = 10**15  # no two calls of this test are that far apart
    calls = [
        ({"running": 0, "queued": 0}, big),  # the first: kept
        ({"running": 0, "queued": 0}, big),  # unchanged: nothing
        ({"running": 4, "queued": 2}, big),  # leaves idle: kept
        ({"running": 5, "queued": 0}, big),  # too soon: dropped (a count at 0 is not idle)
        ({"running": 5, "queued": 1}, big),  # too soon: dropped
        ({"running": 0, "queued": 0}, big),  # idle again: kept
        ({"running": 3, "queued": 1}, 0),  # no interval: kept
    ]
    for values, interval in calls:
        r.counter("requests", values, min_interval_ns=interval)
    kept = [e["args"] for e in r.drain()]
    assert kept == [calls[0][0], calls[2][0], calls[5][0], calls[6][0]]


def test_overlapping_work_takes_rows_of_its_own():
    r = Recorder()
    r.enable()  # (a recorder that is off hands out the row asked for: nothing is recorded on it)
    with r.lane("control") as a, r.lane("control") as b:
        with r.lane("control") as c:
            pass
        assert (a, b, c) == ("control", "control 2", "control 3")
    with r.lane("control") as again:
        assert again == "control"


def test_a_state_row_spans_each_state_but_idle():
    r = Recorder()
    r.enable()
    row = StateRow("scheduler", recorder=r)
    for state in ("idle", "busy", "busy", "paused", "idle", "busy", "idle"):
        row.set(state)
    spans = r.drain()
    assert [e["name"] for e in spans] == ["busy", "paused", "busy"]
    assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in itertools.pairwise(spans))


def test_the_offset_comes_from_the_shortest_round_trip():
    """The remote clock runs 5 ms ahead. The first answer is delayed 3 ms on its way back, the
    third 3 ms on its way there; the second comes and goes in 0.1 ms each way: it is believed."""
    local = iter([0, 4 * MS, 10 * MS, 10_200_000, 20 * MS, 23_500_000])
    remote = iter([5_500_000, 15_100_000, 28 * MS])
    offset = estimate_offset(lambda: next(remote), lambda: next(local), samples=3)
    assert offset == 5 * MS


def test_interval_arithmetic():
    a = union([(5, 8), (0, 2), (1, 3), (8, 9)])
    assert a == [(0, 3), (5, 9)] and length(a) == 7
    assert intersect(a, [(2, 6), (8, 20)]) == [(2, 3), (5, 6), (8, 9)]
    assert intersect(a, []) == []


def event(name: str, start_ms: float, end_ms: float, cat: str = "phase", tid: str = "loop") -> dict[str, Any]:
    return {
        "ph": "X",
        "name": name,
        "cat": cat,
        "ts": int(start_ms * MS),
        "dur": int((end_ms - start_ms) * MS),
        "tid": tid,
    }


def test_the_table_splits_the_wall_time_and_measures_the_overlap():
    """A driver that starts for 10 ms, then two steps of wait 20 + train 30; the engine busy
    during the second step's training (overlap 25 ms of the 60 ms of train calls)."""
    acc = TimeAccount()
    driver = [
        event("startup", 0, 10),
        event("wait_generate", 10, 30),
        event("train", 30, 60),
        event("wait_generate", 60, 80),
        event("train", 80, 110),
        event("rollout 0", 10, 60, "step"),
        event("rollout 1", 60, 110, "step"),
    ]
    for e in driver:
        acc.add("driver", e)
    acc.add("engine 0", event("busy", 85, 110, "state", "scheduler"))
    acc.add("train rank 0", event("actor_train", 30, 60, "pass", "main"))
    acc.add("train rank 0", event("actor_train", 80, 110, "pass", "main"))
    table = "\n".join(acc.table())
    assert "110 ms" not in table and "0.1 s from the driver's start" in table
    assert "train                         0.06 s   54.5%" in table
    assert "wait_generate                 0.04 s   36.4%" in table
    assert "startup                       0.01 s    9.1%" in table
    assert "other                         0.00 s    0.0%" in table
    assert "engine 0                75.0% (no request running)" in table  # busy 25 of the loop's 100 ms
    assert "train rank 0            40.0% (outside its passes)" in table
    assert "overlapped 0.03 s (41.7% of the train calls)" in table


def test_the_trace_file_is_chromes_format_with_each_node_moved_onto_the_drivers_clock(tmp_path):
    start = 1_000 * MS
    trace = TraceFile(str(tmp_path / "traces"), start)
    assert os.path.exists(trace.spool_path) and not os.path.exists(trace.path)  # nothing half-written
    trace.add("driver", [event("startup", 1_000, 1_010)])
    # Until the end, the spool is a trace of its own (Chrome's array form, whose "]" may be missing).
    spooled = json.loads(Path(trace.spool_path).read_text().rstrip().removesuffix(",") + "]")
    assert [e["name"] for e in spooled] == ["process_name", "process_sort_index", "thread_name", "startup"]
    # Another node whose clock is 7 ms ahead: its events are 7 ms later on its own clock.
    trace.add(
        "engine 0",
        [
            event("busy", 1_012 + 7, 1_015 + 7, "state", "scheduler"),
            {
                "ph": "C",
                "name": "requests",
                "ts": (1_013 + 7) * MS,
                "tid": "scheduler",
                "args": {"running": 2},
            },
            {**event("restarting", 1_016, 1_018, "fault", "faults"), "track": "engine 1"},
        ],
        offset_ns=7 * MS,
    )
    path = trace.close()
    assert not os.path.exists(trace.spool_path)
    data = json.loads(Path(path).read_text())
    assert data["otherData"] == {"clock_start_unix_ns": start, "clock_offsets_ns": {"engine 0": 7 * MS}}
    events = data["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(processes.values()) == ["driver", "engine 0", "engine 1"]
    rows = {(processes[e["pid"]], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert rows == {("driver", "loop"), ("engine 0", "scheduler"), ("engine 1", "faults")}
    by_name = {e["name"]: e for e in events if e["ph"] != "M"}
    assert by_name["startup"]["ts"] == 0 and by_name["startup"]["dur"] == 10_000  # microseconds
    assert by_name["busy"]["ts"] == 12_000 and by_name["busy"]["dur"] == 3_000
    assert by_name["requests"]["ts"] == 13_000 and by_name["requests"]["args"] == {"running": 2}
    assert processes[by_name["restarting"]["pid"]] == "engine 1"


def test_a_timeline_that_cannot_be_written_never_fails_the_job(tmp_path, caplog):
    """A full disk under a running job: the drain after a step gives the timeline up, and the end
    of the job says so, raising nothing."""
    from slime.ray.tracing import JobTracing
    from slime.utils.job_trace import RECORDER

    tracing = JobTracing(str(tmp_path / "traces"))  # no job attached: the driver's events only
    try:
        tracing.file._spool = open("/dev/full", "w")  # every flush fails: ENOSPC
        with RECORDER.span("wait_generate", "loop"):
            pass
        tracing.after_step(None, None)  # type: ignore[arg-type]
        assert tracing.given_up is not None
        tracing.finish()
    finally:
        RECORDER.enabled = False
        RECORDER.drain()
    assert "timeline is given up" in caplog.text and "timeline could not be written" in caplog.text


def test_a_trace_dir_that_cannot_be_written_is_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    problem = trace_dir_problem(str(blocker / "traces"))
    assert problem is not None and "--trace-dir" in problem and "is a file, not a directory" in problem
    assert trace_dir_problem(str(tmp_path / "new" / "traces")) is None  # made when the job starts


# ---- an engine over real HTTP ----------------------------------------------------------------------


def _post(url: str, path: str, body: dict[str, Any], key: str) -> int:
    request = urllib.request.Request(
        url + path,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status
    except urllib.error.HTTPError as e:
        return e.code


def _drain_until(engine: Any, events: list[dict[str, Any]], counts: dict[str, int]) -> None:
    """Drain `engine` into `events` until a `requests` counter equal to `counts` comes (the
    engine thread records its counts once per turn, on its own time)."""
    seen, deadline = len(events), time.monotonic() + 120  # a broken engine fails the test, not hangs it
    while not any(e["ph"] == "C" and e["args"] == counts for e in events[seen:]):
        assert time.monotonic() < deadline, f"the engine never recorded {counts}: {events}"
        events += engine.trace_events()


def test_an_engine_records_its_state_its_requests_and_its_control_calls(tiny_model):
    from slime.engines.torch_engine.launcher import start_torch_engine

    key = new_api_key()
    events: list[dict[str, Any]] = []
    with start_torch_engine(tiny_model, ["--num-threads", "1"], env={ENV: "1"}, api_key=key) as engine:
        assert _post(engine.url, "/pause_generation", {"mode": "in_place"}, key) == 200
        body = {
            "input_ids": [[1, 2, 3], [4, 5]],
            "sampling_params": {"max_new_tokens": 4, "ignore_eos": True},
        }
        answer = threading.Thread(target=_post, args=(engine.url, "/generate", body, key))
        answer.start()  # its requests wait while generation is paused
        _drain_until(engine, events, {"running": 0, "queued": 2})
        assert _post(engine.url, "/continue_generation", {}, key) == 200
        answer.join()
        assert _post(engine.url, "/no_such_route", {}, key) == 404
        try:
            urllib.request.urlopen(engine.url + "/slime/trace_events", timeout=30)
            raise AssertionError("the events were given without the key")
        except urllib.error.HTTPError as e:
            assert e.code == 401
        _drain_until(engine, events, {"running": 0, "queued": 0})
    assert len({json.dumps(e, sort_keys=True) for e in events}) == len(events)  # each given out once
    names = [(e["tid"], e["ph"], e["name"]) for e in events]
    assert ("control", "X", "pause_generation") in names and ("control", "X", "continue_generation") in names
    assert not any("no_such_route" in n or n == "generate" for _, _, n in names)
    assert ("scheduler", "X", "paused") in names and ("scheduler", "X", "busy") in names
    paused = [e for e in events if e["name"] == "paused"]  # cut where a drain came
    busy = next(e for e in events if e["name"] == "busy")
    assert all(p["ts"] + p["dur"] <= busy["ts"] for p in paused)  # generation ran once it went on
    assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in itertools.pairwise(paused))


# ---- the trace of a job ------------------------------------------------------------------------------


def check_job_trace(trace_dir: Path, tracks: set[str]) -> dict[str, list[dict[str, Any]]]:
    """The one trace in `trace_dir`, parsed back: the `tracks` present (and no other), each row's
    spans nested or apart, and each row's clock never going backward. Returns the events by track."""
    (path,) = trace_dir.iterdir()  # the spool is gone
    assert path.name.startswith("trace-") and path.suffix == ".json"
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert set(names.values()) == tracks
    rows: dict[tuple[int, int], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["ph"] != "M":
            rows[(e["pid"], e["tid"])].append(e)
    for row in rows.values():
        ends = [e["ts"] + e.get("dur", 0) for e in row]
        assert ends == sorted(ends), "a clock went backward"
        stack: list[float] = []
        for span in sorted((e for e in row if e["ph"] == "X"), key=lambda e: (e["ts"], -e["dur"])):
            while stack and stack[-1] <= span["ts"] + 0.002:
                stack.pop()
            end = span["ts"] + span["dur"]
            assert not stack or end <= stack[-1] + 0.002, (
                f"{span['name']} overlaps its neighbour without nesting"
            )
            stack.append(end)
    out: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["ph"] != "M":
            out[names[e["pid"]]].append(e)
    return out


def test_a_trace_dir_that_cannot_be_written_ends_the_job_with_exit_2(tiny_model, tmp_path):
    from tests.test_loop_e2e import run_job

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    prompts = tmp_path / "train.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    trace_dir = str(blocker / "traces")
    proc = run_job(
        "train.py", tiny_model, str(prompts), tmp_path, "--rm-type", "exact", "--trace-dir", trace_dir
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "--trace-dir" in proc.stderr and "Traceback" not in proc.stderr
    assert "Connecting to existing Ray cluster" not in proc.stderr  # refused before anything started


COLOCATED = [
    *("--rm-type", "exact", "--colocate", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2"),
    *("--num-rollout", "3", "--use-fault-tolerance", "--rollout-health-check-interval", "0.2"),
    *("--rollout-health-check-first-wait", "0"),
]
TRACKS = {
    "driver",
    "rollout manager",
    "engine 0",
    "engine 1",
    "train rank 0",
    "train rank 1",
    "health checks",
}


@pytest.mark.slow  # ~25 s
@pytest.mark.e2e
def test_a_colocated_job_with_health_checks_has_a_track_for_every_process(tiny_model, tmp_path):
    """train.py --colocate with two engines, two train ranks and the health monitor: each
    process's track, the engines giving their memory up for every train step, and the health
    checks on a track of their own."""
    from tests.test_loop_e2e import run_job

    prompts = tmp_path / "train.jsonl"
    prompts.write_text(
        "".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(8))
    )
    trace_dir = tmp_path / "trace"
    proc = run_job("train.py", tiny_model, str(prompts), tmp_path, *COLOCATED, "--trace-dir", str(trace_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    tracks = check_job_trace(trace_dir, TRACKS)
    for j in (0, 1):
        states = [e["name"] for e in tracks[f"engine {j}"] if e.get("cat") == "state"]
        assert states.count("memory released") == 3 and "busy" in states
    phases = {e["name"] for e in tracks["driver"]}
    assert {"startup", "colocate", "rollout_offload", "wake_up", "push", "update_weights"} <= phases
    assert any(e["name"] == "health check" for e in tracks["health checks"])
    assert "engine 0" in proc.stderr and "(no request running)" in proc.stderr


def test_plot_timeline_draws_a_trace_and_refuses_what_is_not_one(tmp_path, capsys):
    from PIL import Image

    from slime.tools.plot_timeline import main as plot

    trace = TraceFile(str(tmp_path), 0, name="trace.json")
    trace.add("driver", [event("startup", 0, 10), event("rollout 0", 10, 60, "step"), event("train", 20, 50)])
    counts = [
        {"ph": "C", "name": "requests", "ts": t * MS, "tid": "scheduler", "args": {"running": n}}
        for t, n in ((12, 0), (15, 8), (40, 0))
    ]
    trace.add("engine 0", [event("busy", 15, 40, "state", "scheduler"), *counts])
    path = trace.close()
    out = tmp_path / "timeline.png"
    assert plot([path, "--out", str(out), "--width", "8"]) == 0
    with Image.open(out) as image:
        assert image.width == 8 * 150 and image.height > 200
    assert plot([path, "--to", "-1"]) == 2  # nothing before the start
    not_json = tmp_path / "notes.json"
    not_json.write_text("not json")
    no_events = tmp_path / "other.json"
    no_events.write_text('{"rows": []}')
    assert plot([str(not_json)]) == 2 and plot([str(no_events)]) == 2
    err = capsys.readouterr().err
    assert "notes.json: not a readable JSON trace" in err and "other.json: no Chrome trace events" in err
