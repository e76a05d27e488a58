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
from slime.observability.job_trace import RECORDER
from slime.observability.timeline import TraceFile, estimate_offset

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 120.0
"""How long the driver waits for one process's events (a train rank answers after its call)."""


class JobTracing(Hook):
    """The timeline of one job: `attach(job)` once its processes run, a drain after every step,
    `finish()` at the end (writes the trace and logs where the time went)."""

    def __init__(self, trace_dir: str):
        RECORDER.enable()
        self.file = TraceFile(trace_dir, RECORDER.now_ns())
        self.job: Any = None
        self.node: str | None = None
        self.node_offsets: dict[str, int] = {}
        """Node address -> how far its clock is ahead of the driver's (ns)."""
        self.actor_nodes: dict[Any, str] = {}
        self.finished = False

    def attach(self, job: Any) -> None:
        from slime.ray.actors import node_ip

        self.job = job
        self.node = node_ip()
        self.node_offsets[self.node] = 0

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
        with RECORDER.span("drain timeline", "loop", "tracing"):  # its own cost, on the driver's path
            self.collect()

    def collect(self) -> None:
        sources = self.sources()
        refs = [actor.trace_events.remote() for _, actor in sources]
        for (track, actor), ref in zip(sources, refs, strict=True):
            try:
                events = ray.get(ref, timeout=DRAIN_TIMEOUT_S)
                offset = self._offset(actor)
            except Exception as e:  # a dead process: its events are gone, the others are kept
                logger.warning("the timeline has no more events of %s: %s", track, e)
                RECORDER.instant("events lost", track=track, cat="fault", error=str(e)[:200])
                continue
            self.file.add(track, events, offset)
        self.file.add("driver", RECORDER.drain())

    def _offset(self, actor: Any) -> int:
        """How far the clock of `actor`'s node is ahead of the driver's (measured once per node)."""
        key = actor._actor_id
        if key not in self.actor_nodes:
            self.actor_nodes[key] = ray.get(actor.trace_node.remote(), timeout=DRAIN_TIMEOUT_S)
        node = self.actor_nodes[key]
        if node not in self.node_offsets:

            def remote() -> int:
                return int(ray.get(actor.trace_clock.remote(), timeout=DRAIN_TIMEOUT_S))

            self.node_offsets[node] = estimate_offset(remote, RECORDER.now_ns)
            logger.info(
                "timeline: node %s's clock is %+.3f ms from the driver's", node, self.node_offsets[node] / 1e6
            )
        return self.node_offsets[node]

    def finish(self) -> None:
        """The last events, the trace written, the table logged; once, even after a failure (with
        what the processes still alive give)."""
        if self.finished:
            return
        self.finished = True
        try:
            self.collect()
        except Exception as e:
            logger.warning("the last drain of the timeline failed: %s", e)
            self.file.add("driver", RECORDER.drain())
        path = self.file.close()
        logger.info("%s", "\n".join(self.file.account.table()))
        logger.info("the job's timeline: %s (open it in https://ui.perfetto.dev or chrome://tracing)", path)
