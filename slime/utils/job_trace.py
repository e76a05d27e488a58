"""What this process did and when, for the job's timeline (--trace-dir; slime.observability.timeline).

Every process of a job (the driver, the rollout manager, each engine, each train rank) has one
`RECORDER`. It is off unless the job asked for a timeline: the driver turns its own on, and the
other processes start with `SLIME_TRACE_EVENTS=1` in their environment. Off, each call is one
attribute test. On, an event is a small dict appended to a deque (thread-safe appends); the driver
drains every process's events after each step and writes them into one Chrome trace-event file.

Timestamps are this machine's wall clock in nanoseconds, read as a monotonic clock plus the wall
time at which the recorder started: they never go backward within a process (a wall-clock step
does not reorder its events), and processes on one node agree. The driver measures each other
node's offset against its own (slime.observability.timeline.estimate_offset).

Events come in three kinds, Chrome's: a span ("X": a name, a start and a duration), an instant
("i": something that happened: a retry, an engine marked down) and a counter ("C": numbers
sampled over time, such as an engine's running requests). `thread` names the row of the process's
track the event goes on; spans on one row must nest, so concurrent work takes rows of its own.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

ENV = "SLIME_TRACE_EVENTS"
"""Set to 1 in a process's environment to record (the job sets it for the processes it starts)."""


class Recorder:
    def __init__(self) -> None:
        self.enabled = False
        self._events: collections.deque[dict[str, Any]] = collections.deque()
        self._wall0 = time.time_ns()
        self._mono0 = time.monotonic_ns()
        self._counters: dict[tuple[str, str], tuple[int, Mapping[str, float]]] = {}
        self._lanes: dict[str, list[bool]] = {}
        self._lanes_lock = threading.Lock()

    def enable(self) -> None:
        """Start recording (the clock's anchor is taken again: timestamps from now)."""
        self._wall0, self._mono0 = time.time_ns(), time.monotonic_ns()
        self.enabled = True

    def now_ns(self) -> int:
        """This process's clock: wall-clock nanoseconds that never go backward."""
        return self._wall0 + time.monotonic_ns() - self._mono0

    @contextlib.contextmanager
    def span(
        self, name: str, thread: str = "main", cat: str = "phase", *, track: str | None = None, **args: Any
    ) -> Iterator[None]:
        """A span around the block (recorded when it ends, an exception included: then with
        `error` in its args). `track`: another process's track than this one's (the driver
        marks an engine's restart on the engine's)."""
        if not self.enabled:
            yield
            return
        start = self.now_ns()
        try:
            yield
        except BaseException as e:
            args["error"] = f"{type(e).__name__}: {e}"[:200]
            raise
        finally:
            self.complete(name, start, self.now_ns(), thread, cat, track=track, **args)

    def complete(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        thread: str = "main",
        cat: str = "phase",
        *,
        track: str | None = None,
        **args: Any,
    ) -> None:
        """A span already timed (`start_ns`, `end_ns` from now_ns())."""
        if self.enabled:
            event = {"ph": "X", "name": name, "cat": cat, "ts": start_ns, "dur": max(0, end_ns - start_ns)}
            self._events.append(_with(event, thread, args, track))

    def instant(
        self, name: str, thread: str = "main", cat: str = "event", *, track: str | None = None, **args: Any
    ) -> None:
        if self.enabled:
            event = {"ph": "i", "s": "t", "name": name, "cat": cat, "ts": self.now_ns()}
            self._events.append(_with(event, thread, args, track))

    def counter(
        self, name: str, values: Mapping[str, float], thread: str = "main", min_interval_ns: int = 0
    ) -> None:
        """Counter values, recorded only when they changed, and at most once per
        `min_interval_ns` unless they all come to 0 or leave it (so that idle periods are exact
        while a busy engine's counts are thinned out). One thread per (thread, name)."""
        if not self.enabled:
            return
        now = self.now_ns()
        key = (thread, name)
        last = self._counters.get(key)
        if last is not None:
            when, before = last
            if before == values:
                return
            idle_changed = any(before.values()) != any(values.values())
            if not idle_changed and now - when < min_interval_ns:
                return
        self._counters[key] = (now, dict(values))
        self._events.append(
            _with({"ph": "C", "name": name, "cat": "counter", "ts": now}, thread, dict(values))
        )

    @contextlib.contextmanager
    def lane(self, thread: str) -> Iterator[str]:
        """A row for work that may overlap other work of its kind (concurrent HTTP requests): the
        first of `thread`, `thread 2`, ... that no unfinished span holds (no bookkeeping when the
        process does not record: a rollout takes one per prompt group)."""
        if not self.enabled:
            yield thread
            return
        with self._lanes_lock:
            busy = self._lanes.setdefault(thread, [])
            k = busy.index(False) if False in busy else len(busy)
            if k == len(busy):
                busy.append(True)
            busy[k] = True
        try:
            yield thread if k == 0 else f"{thread} {k + 1}"
        finally:
            with self._lanes_lock:
                busy[k] = False

    def drain(self) -> list[dict[str, Any]]:
        """The events recorded since the last drain, oldest first (each is given out once)."""
        out = []
        while True:
            try:
                out.append(self._events.popleft())
            except IndexError:
                return out


class StateRow:
    """One row of spans for a thing that is in one state at a time (an engine: busy, paused,
    memory released): `set(state)` at each look ends the previous state's span when it changes.
    States in `quiet` (idle) get no span: the gaps between spans are them."""

    def __init__(self, thread: str, quiet: tuple[str, ...] = ("idle",), recorder: Recorder | None = None):
        self.thread, self.quiet = thread, quiet
        self.recorder = recorder or RECORDER
        self.state: str | None = None
        self.since = 0

    def set(self, state: str) -> None:
        if state == self.state or not self.recorder.enabled:
            return
        now = self.recorder.now_ns()
        if self.state is not None and self.state not in self.quiet:
            self.recorder.complete(self.state, self.since, now, self.thread, cat="state")
        self.state, self.since = state, now

    def cut(self) -> None:
        """End the current state's span now and start it again (a drain takes what happened up
        to now; a span left open until the state changes would be lost if it never did)."""
        if self.state is not None and self.recorder.enabled:
            state, self.state = self.state, None
            self.set(state)


def _with(
    event: dict[str, Any], thread: str, args: dict[str, Any], track: str | None = None
) -> dict[str, Any]:
    event["tid"] = thread
    if track is not None:
        event["track"] = track
    if args:
        event["args"] = args
    return event


RECORDER = Recorder()
if os.environ.get(ENV) == "1":
    RECORDER.enable()

span = RECORDER.span
complete = RECORDER.complete
instant = RECORDER.instant
counter = RECORDER.counter
