"""The job's timeline file (--trace-dir) and its "where the time went" table, in the driver.

Every process records its events (slime.utils.job_trace); the driver drains them after
each step and hands them here with the name of the track they belong on ("driver", "engine 0",
"train rank 1", ...). They are written at once to a spool file beside the trace (so a long job
holds none of them in memory, and a job that fails keeps what it recorded), and at the end the
trace is written in Chrome's trace-event format (the JSON object form: `traceEvents`, with
`process_name` / `thread_name` metadata), which Perfetto (ui.perfetto.dev) and chrome://tracing
open. The file appears whole or not at all: it is written beside and renamed into place.

One track (a Chrome "process") per process of the job, one row ("thread") per kind of work in it.
Times are microseconds from the driver's start, each event moved by its node's clock offset
(`estimate_offset`), so the tracks of processes on different nodes line up.
"""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TextIO

from slime.utils.files import atomic_text_file

Interval = tuple[int, int]


def trace_dir_problem(path: str) -> str | None:
    """Why the timeline cannot be written into --trace-dir `path` (None: it can): the directory,
    or the nearest of its parents that exists, must be a directory this user may write in."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    what = None
    if not os.path.isdir(probe):
        what = "is a file, not a directory"
    elif not os.access(probe, os.W_OK | os.X_OK):
        what = "is a directory this user may not write in"
    if what is None:
        return None
    return f"--trace-dir {path}: {probe} {what}; give a directory the job can create or write its trace in"


def estimate_offset(remote_clock: Callable[[], int], local_clock: Callable[[], int], samples: int = 5) -> int:
    """How far another clock is ahead of ours, in nanoseconds: read it between two readings of
    ours, `samples` times, and keep the reading with the shortest round trip (the one least
    delayed on the way), taken to be read half way through it (NTP's estimate)."""
    best: tuple[int, int] | None = None
    for _ in range(samples):
        t0 = local_clock()
        remote = remote_clock()
        t1 = local_clock()
        if best is None or t1 - t0 < best[0]:
            best = (t1 - t0, remote - (t0 + t1) // 2)
    assert best is not None
    return best[1]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The intervals merged where they overlap, in order."""
    out: list[list[int]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def length(intervals: Iterable[Interval]) -> int:
    return sum(b - a for a, b in intervals)


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """Where two unions (sorted, disjoint) overlap."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(intervals: list[Interval], window: Interval) -> list[Interval]:
    return intersect(union(intervals), [window])


def _keep(intervals: list[Interval], interval: Interval, bound: int = 4096) -> None:
    """Add `interval`, merging the list whenever it grows past `bound` (a long job's thousands of
    busy spans take the room of the gaps between them)."""
    intervals.append(interval)
    if len(intervals) > bound:
        intervals[:] = union(intervals)


ENGINE_TRACKS = ("engine ", "teacher engine")
RANK_TRACKS = ("train rank ", "critic rank ")


@dataclass
class TimeAccount:
    """What the table needs, gathered from the events as they pass (a few spans per step)."""

    phases: dict[str, int] = field(default_factory=dict)
    """Nanoseconds of each of the driver's phases (its spans of category "phase")."""
    loop: Interval | None = None
    """From the start of the first step to the end of the last."""
    trains: list[Interval] = field(default_factory=list)
    """The driver's train calls."""
    generating: list[Interval] = field(default_factory=list)
    """The rollout manager's generations (where no engine reports its own busy time)."""
    engine_busy: dict[str, list[Interval]] = field(default_factory=dict)
    rank_busy: dict[str, list[Interval]] = field(default_factory=dict)
    """Each train rank's passes (log-probs, train steps) and pushes."""
    first: int | None = None
    last: int | None = None

    def add(self, track: str, event: dict[str, Any]) -> None:
        start = int(event["ts"])
        end = start + int(event.get("dur", 0))
        self.first = start if self.first is None else min(self.first, start)
        self.last = end if self.last is None else max(self.last, end)
        engine, rank = track.startswith(ENGINE_TRACKS), track.startswith(RANK_TRACKS)
        if engine or rank:  # every one gets its line, a never busy one too
            (self.engine_busy if engine else self.rank_busy).setdefault(track, [])
        if event["ph"] != "X":
            return
        name, cat = event["name"], event.get("cat")
        if track == "driver":
            if cat == "phase":
                self.phases[name] = self.phases.get(name, 0) + end - start
                if name == "train":
                    _keep(self.trains, (start, end))
            elif cat == "step":
                self.loop = (min(start, self.loop[0]), max(end, self.loop[1])) if self.loop else (start, end)
        elif engine and name == "busy":
            _keep(self.engine_busy[track], (start, end))
        elif track == "rollout manager" and name == "generate":
            _keep(self.generating, (start, end))
        elif rank and cat in ("pass", "push"):
            _keep(self.rank_busy[track], (start, end))

    def table(self) -> list[str]:
        """The "where the time went" lines: each driver phase's share of the job's wall time,
        each engine's and train rank's idle share of the loop's time, and how much generation
        and training overlapped."""
        if self.first is None or self.last is None:
            return ["where the time went: nothing was recorded"]
        wall = max(1, self.last - self.first)
        lines = [f"where the time went ({wall / 1e9:.1f} s from the driver's start to the last event):"]
        named = sorted(self.phases.items(), key=lambda kv: -kv[1])
        for name, ns in [*named, ("other", max(0, wall - sum(self.phases.values())))]:
            lines.append(f"  {name:<24}{ns / 1e9:>10.2f} s {100 * ns / wall:>6.1f}%")
        loop = self.loop
        if loop is None:
            return lines
        span = max(1, loop[1] - loop[0])
        lines.append(f"  idle during the loop ({span / 1e9:.1f} s, its first step to its last):")
        for track, busy in sorted({**self.engine_busy, **self.rank_busy}.items()):
            idle = span - length(clip(busy, loop))
            what = "no request running" if track.startswith(("engine", "teacher")) else "outside its passes"
            lines.append(f"    {track:<22}{100 * idle / span:>6.1f}% ({what})")
        generation = union(b for busy in self.engine_busy.values() for b in busy) or union(self.generating)
        trains = union(self.trains)
        if trains:
            both = length(intersect(generation, trains))
            share = 100 * both / max(1, length(trains))
            lines.append(
                f"  generation and training overlapped {both / 1e9:.2f} s ({share:.1f}% of the train calls)"
            )
        return lines


@dataclass
class _Track:
    pid: int
    rows: dict[str, int] = field(default_factory=dict)


class TraceFile:
    """The trace under construction: `add(track, events, offset_ns)` as they are drained,
    `close()` at the end (returns the trace's path).

    The spool is itself a trace in Chrome's JSON-array form, whose closing bracket the format
    allows to be missing, with each track's and row's name written where it first appears: the
    spool of a driver that was killed opens in Perfetto as it is."""

    def __init__(self, trace_dir: str, start_ns: int, name: str | None = None):
        """`start_ns`: time 0 of the trace (the driver's clock); `name`: the file's name (default
        trace-<local date and time>-<driver pid>.json, a new file for every job)."""
        os.makedirs(trace_dir, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.path = os.path.join(trace_dir, name or f"trace-{stamp}-{os.getpid()}.json")
        self.spool_path = os.path.splitext(self.path)[0] + ".partial.json"
        self._spool: TextIO | None = open(self.spool_path, "w")  # noqa: SIM115 - open until close()
        self._spool.write("[\n")
        self.start_ns = start_ns
        self.tracks: dict[str, _Track] = {}
        self.account = TimeAccount()
        self.offsets: dict[str, int] = {}

    def track(self, name: str) -> _Track:
        """Track `name`, numbered in the order they appear (its name written then)."""
        if name not in self.tracks:
            t = self.tracks[name] = _Track(len(self.tracks) + 1)
            self._write({"ph": "M", "name": "process_name", "pid": t.pid, "tid": 0, "args": {"name": name}})
            self._write(
                {
                    "ph": "M",
                    "name": "process_sort_index",
                    "pid": t.pid,
                    "tid": 0,
                    "args": {"sort_index": t.pid},
                }
            )
        return self.tracks[name]

    def _row(self, t: _Track, row: str) -> int:
        if row not in t.rows:
            tid = t.rows[row] = len(t.rows) + 1
            self._write({"ph": "M", "name": "thread_name", "pid": t.pid, "tid": tid, "args": {"name": row}})
        return t.rows[row]

    def _write(self, event: dict[str, Any]) -> None:
        assert self._spool is not None, "the trace is closed"
        self._spool.write(json.dumps(event, separators=(",", ":")) + ",\n")

    def add(self, track: str, events: list[dict[str, Any]], offset_ns: int = 0) -> None:
        """Events of one process (job_trace's form: absolute nanoseconds on its own clock, rows
        by name), moved by `offset_ns` (how far that clock is ahead of the driver's)."""
        assert self._spool is not None, "the trace is closed"
        if offset_ns:
            self.offsets[track] = offset_ns
        for event in events:
            event = dict(event)
            event["ts"] = int(event["ts"]) - offset_ns
            name = str(event.pop("track", track))
            t = self.track(name)
            self.account.add(name, event)
            event["tid"] = self._row(t, str(event.pop("tid", "main")))
            event["pid"] = t.pid
            event["ts"] = round((event["ts"] - self.start_ns) / 1e3, 3)
            if "dur" in event:
                event["dur"] = round(int(event["dur"]) / 1e3, 3)
            self._write(event)
        self._spool.flush()

    def close(self) -> str:
        """Write the trace (the spool's events, in the JSON object form) and remove the spool."""
        if self._spool is None:
            return self.path
        self._spool.close()
        self._spool = None
        other = {"clock_start_unix_ns": self.start_ns, "clock_offsets_ns": self.offsets}
        with atomic_text_file(self.path) as out, open(self.spool_path) as spool:
            out.write('{"displayTimeUnit":"ms","otherData":' + json.dumps(other) + ',"traceEvents":[\n')
            next(spool)  # its opening bracket
            for k, line in enumerate(spool):
                out.write(("," if k else "") + line.rstrip().removesuffix(",") + "\n")
            out.write("]}\n")
        os.chmod(self.path, stat.S_IMODE(os.stat(self.spool_path).st_mode))  # as the spool: the umask's
        os.remove(self.spool_path)
        return self.path
