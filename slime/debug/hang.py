"""`--hang-timeout`: a per-process watchdog that writes every thread's Python stack when a
phase (a train step, a weight push) runs too long.

A sharded job hangs as a whole: one rank stops (a deadlock, a debugger, a slow filesystem) and
every other rank waits for it inside a collective. The stacks of all ranks, side by side, show
which rank is elsewhere and where. Each train rank arms its watchdog around the phases the
driver waits on; when one is still running after the timeout, the watchdog thread writes

    <log dir>/hang/rank{r}.txt

(the phase, how long it has run, then every thread's stack, the phase's thread first). The
driver, which waits on the same phase with the same timeout, then ends the job with exit code
1 and names the directory. A thread blocked in a collective releases the GIL, so the watchdog
thread runs; a C call that holds the GIL forever would stop it too (`py-spy dump` then helps).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator

from slime.utils.files import atomic_write_text

WATCHDOG_THREAD = "slime-hang-watchdog"


def format_stacks(first: int | None = None) -> str:
    """Every thread's current Python stack (watchdog threads left out), thread `first` (an
    ident) first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    frames = sys._current_frames()
    order = sorted(frames, key=lambda ident: (ident != first, names.get(ident, "")))
    parts = []
    for ident in order:
        if names.get(ident) == WATCHDOG_THREAD:
            continue
        stack = "".join(traceback.format_stack(frames[ident]))
        parts.append(f'Thread "{names.get(ident, "?")}" (ident {ident}), most recent call last:\n{stack}')
    return "\n".join(parts)


class HangError(RuntimeError):
    """A phase ran longer than --hang-timeout; the message names the stack dumps."""


def wait_for_dumps(hang_dir: str, num_ranks: int, grace_s: float = 30.0, prefix: str = "") -> list[str]:
    """The {prefix}rank{r}.txt files in `hang_dir` once all `num_ranks` exist, or after `grace_s`
    (the ranks armed their watchdogs a little after the driver started waiting). `prefix`:
    "critic" for PPO's critic ranks (slime.ray.actors.TrainRank)."""
    deadline = time.monotonic() + grace_s
    while True:
        names = [f"{prefix}rank{r}.txt" for r in range(num_ranks)]
        found = [n for n in names if os.path.exists(os.path.join(hang_dir, n))]
        if len(found) == num_ranks or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


class HangWatchdog:
    """`with watchdog.watch("train step of rollout 3"): ...` in the thread that runs the phase."""

    def __init__(self, timeout_s: float, path: str, header: str = ""):
        if timeout_s <= 0:
            raise ValueError(f"--hang-timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self.path = path
        self.header = header
        self._cond = threading.Condition()
        self._phase: tuple[int, str, float, int] | None = None  # (token, what, start, thread ident)
        self._token = 0
        self.fired: list[str] = []
        threading.Thread(target=self._run, name=WATCHDOG_THREAD, daemon=True).start()

    @contextlib.contextmanager
    def watch(self, what: str) -> Iterator[None]:
        with self._cond:
            self._token += 1
            self._phase = (self._token, what, time.monotonic(), threading.get_ident())
            self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._phase = None
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._phase is None:
                    self._cond.wait()
                token, what, start, ident = self._phase
                deadline = start + self.timeout_s
                while self._phase is not None and self._phase[0] == token and time.monotonic() < deadline:
                    self._cond.wait(deadline - time.monotonic())
                if self._phase is None or self._phase[0] != token:
                    continue
            self._dump(what, time.monotonic() - start, ident)
            with self._cond:  # one dump per phase: wait for it to end
                while self._phase is not None and self._phase[0] == token:
                    self._cond.wait()

    def _dump(self, what: str, elapsed: float, ident: int) -> None:
        text = (
            f"{self.header}pid {os.getpid()}: {what} has run {elapsed:.1f} s "
            f"(--hang-timeout {self.timeout_s:g} s)\n\n{format_stacks(first=ident)}"
        )
        atomic_write_text(self.path, text)
        self.fired.append(what)
