"""--trace-dir in the driver: every process of the job drained into one timeline.

After each step (and once more at the end, failed or not) the driver asks every process it started
for the events recorded since the last time (their `trace_events()`; an engine's actor adds its
server's), and writes them on their process's track (slime.observability.timeline.TraceFile). A
process on another node has its clock compared with the driver's once (five round trips, the
shortest kept), and its events are moved by the difference. A process that died takes its
unread events with it; the timeline says so with an instant on its track.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from slime.loop.core import Hook, Loop
from slime.loop.parts import Step
from slime.observability.timeline import TraceFile, estimate_offset
from slime.utils.job_trace import RECORDER

logger = logging.getLogger(__name__)

STEP_WAIT_S = 10.0
"""How long a drain after a step waits for the processes' events; one that answers later (a
restarting engine, still loading) is read at the next drain."""
FINAL_WAIT_S = 30.0
"""How long the last drain waits, all processes together."""


class JobTracing(Hook):
    """The timeline of one job: `attach(job)` once its processes run, a drain after every step,
    `finish()` at the end (writes the trace and logs where the time went). Never the cause of a
    job's failure: a timeline that cannot be written is given up with a warning."""

    def __init__(self, trace_dir: str):
        RECORDER.enable()
        self.file = TraceFile(trace_dir, RECORDER.now_ns())
        self.file.track("driver")  # the first track
        self.job: Any = None
        self.node_offsets: dict[str, int] = {}
        """Node address -> how far its clock is ahead of the driver's (ns)."""
        self.actor_nodes: dict[Any, str] = {}
        self.pending: dict[str, tuple[Any, Any]] = {}
        """Track -> (actor, its trace_events call not answered yet)."""
        self.given_up: str | None = None
        self.finished = False

    def attach(self, job: Any) -> None:
        from slime.ray.actors import node_ip

        self.job = job
        self.node_offsets[node_ip()] = 0

    def sources(self) -> list[tuple[str, Any]]:
        """(track, actor) of every process the job runs now (a restarted engine's new actor)."""
        job = self.job
        if job is None:
            return []
        out = [("rollout manager", job.manager)] if job.manager is not None else []
        out += [(f"engine {j}", a) for j, a in enumerate(job.engines)]
        out += [("teacher engine", job.teacher)] if job.teacher is not None else []
        out += [(f"train rank {r}", a) for r, a in enumerate(job.train)]
        out += [(f"critic rank {r}", a) for r, a in enumerate(job.critic)]
        return out

    def after_step(self, loop: Loop, step: Step) -> None:
        if self.given_up is not None:
            return
        with RECORDER.span("drain timeline", "loop", "tracing"):  # its own cost, on the driver's path
            try:
                self.collect(STEP_WAIT_S)
            except Exception as e:  # the trace's file: the job goes on without its timeline
                self.given_up = f"{type(e).__name__}: {e}"
                logger.warning("the job's timeline is given up (the job goes on): %s", self.given_up)

    def collect(self, wait_s: float) -> None:
        """Ask every process for its events (unless it has not answered the last time yet),
        wait up to `wait_s` for all, write those that came."""
        for track, actor in self.sources():
            asked = self.pending.get(track)
            if asked is not None and asked[0] is actor:
                continue
            if asked is not None:  # replaced (a restarted engine) before it answered
                self._read(track, *asked)
            self.pending[track] = (actor, actor.trace_events.remote())
        refs = [ref for _, ref in self.pending.values()]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=wait_s)
        for track, (actor, ref) in list(self.pending.items()):
            if ray.wait([ref], timeout=0)[0]:
                del self.pending[track]
                self._read(track, actor, ref)
        self.file.add("driver", RECORDER.drain())

    def _read(self, track: str, actor: Any, ref: Any) -> None:
        try:
            events = ray.get(ref, timeout=0)
        except Exception as e:  # a dead process: its events are gone, the others are kept
            self._lost(track, e)
            return
        self.file.add(track, events, self._offset(track, actor))

    def _lost(self, track: str, why: object) -> None:
        logger.warning("the timeline has no more events of %s: %s", track, why)
        RECORDER.instant("events lost", track=track, cat="fault", error=str(why)[:200])

    def _offset(self, track: str, actor: Any) -> int:
        """How far the clock of `actor`'s node is ahead of the driver's (measured once per node;
        0, said in the log, where it cannot be measured)."""
        try:
            key = actor._actor_id
            if key not in self.actor_nodes:
                self.actor_nodes[key] = ray.get(actor.trace_node.remote(), timeout=STEP_WAIT_S)
            node = self.actor_nodes[key]
            if node not in self.node_offsets:

                def remote() -> int:
                    return int(ray.get(actor.trace_clock.remote(), timeout=STEP_WAIT_S))

                self.node_offsets[node] = estimate_offset(remote, RECORDER.now_ns)
                offset = self.node_offsets[node]
                logger.info("timeline: node %s's clock is %+.3f ms from the driver's", node, offset / 1e6)
            return self.node_offsets[node]
        except Exception as e:
            logger.warning(
                "timeline: the clock of %s could not be compared with the driver's (%s); taken as equal",
                track,
                e,
            )
            return 0

    def finish(self) -> None:
        """The last events, the trace written, the table logged; once, even after a failure (with
        what the processes still alive give within FINAL_WAIT_S). Raises nothing."""
        if self.finished:
            return
        self.finished = True
        try:
            if self.given_up is None:
                self.collect(FINAL_WAIT_S)
                for track in list(self.pending):
                    self._lost(track, f"it did not answer within {FINAL_WAIT_S:.0f} s")
                self.file.add("driver", RECORDER.drain())
            path = self.file.close()
        except Exception as e:
            logger.warning("the job's timeline could not be written: %s: %s", type(e).__name__, e)
            return
        logger.info("%s", "\n".join(self.file.account.table()))
        logger.info("the job's timeline: %s (open it in https://ui.perfetto.dev)", path)
