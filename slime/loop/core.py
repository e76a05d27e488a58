"""The RL loop: for each rollout, get it, train on it, push the weights, run the hooks.

It drives three typed parts (slime.loop.parts): where rollouts come from, the train ranks and the
engines, any of which a debug mode leaves out (rollout only: no train group; train only: no
engine group). A schedule says how far generation runs ahead of training; hooks add the checks,
evaluation, checkpoints and metrics around the steps. Nothing here knows about Ray.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slime.debug.phases import no_hook
from slime.loop.parts import (
    CACHE_TAGS,
    WEIGHT_TAGS,
    EngineGroup,
    RolloutSource,
    Step,
    TrainGroup,
    TrainRankDied,
)
from slime.utils.job_trace import span
from slime.utils.rollout_batch import Rollout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Schedule:
    """When the next rollout starts: `lookahead` rollouts before the one being trained is done
    (0: synchronous, train.py; 1: one step off-policy, train_async.py), and the most weight
    versions a sample may be behind the trainer (`max_lag`; None: the source bounds it itself,
    as the continuous source does per trained token). With a lookahead the push waits until
    generation is idle; the continuous source (--fully-async) has lookahead 0: it generates
    across rollouts and pushes on its own, and pushes pause its requests in flight."""

    name: str
    lookahead: int
    max_lag: int | None

    def check_staleness(self, rollout: Rollout, version: int) -> None:
        """Versions None are samples no engine reported a version for (an SFT rollout, a custom
        function that did not record it): nothing to check, said once per rollout."""
        if self.max_lag is None:
            return
        if None in rollout.weight_versions:
            logger.warning(
                "rollout %d has samples without a weight version: their staleness is not checked",
                rollout.rollout_id,
            )
        for v in rollout.weight_versions:
            if v is not None and version - int(v) > self.max_lag:
                raise RuntimeError(
                    f"a sample of rollout {rollout.rollout_id} was generated with weight_version {v} while "
                    f"the trainer is at {version}: more than {self.max_lag} version(s) stale"
                )


SYNC = Schedule("synchronous", 0, 0)
ONE_STEP_OFF = Schedule("one step off-policy", 1, 1)
CONTINUOUS = Schedule("continuous", 0, None)


class Hook:
    """Work around the steps; every method is optional."""

    def before_loop(self, loop: Loop) -> bool:
        """Before the first rollout. True: a check mode that ends the job here."""
        return False

    def after_train(self, loop: Loop, step: Step) -> None: ...

    def after_step(self, loop: Loop, step: Step) -> None:
        """After the push (rollout only: after the rollout); may add to `step.record`."""

    def after_loop(self, loop: Loop) -> None: ...


class Loop:
    def __init__(
        self,
        source: RolloutSource,
        train: TrainGroup | None,
        engines: EngineGroup | None,
        schedule: Schedule,
        hooks: list[Hook],
        total: int,
        phase: Callable[..., None] | None = None,
        push_interval: int = 1,
        start: int | None = None,
    ):
        """`phase`: --debug-phase-hook (slime.debug.phases), called at the driver's phases.
        `push_interval` (--update-weights-interval): the weights go to the engines after every
        that many trained rollouts, so samples may be that many versions less one older than the
        schedule allows otherwise. `start` (--start-rollout-id): the first rollout, in place of
        the one after the checkpoint resumed from (or 0)."""
        self.source, self.train, self.engines = source, train, engines
        if push_interval > 1 and schedule.max_lag is not None:
            schedule = dataclasses.replace(schedule, max_lag=schedule.max_lag + push_interval - 1)
        self.schedule, self.hooks, self.total = schedule, hooks, total
        self.phase = phase or no_hook
        self.push_interval = push_interval
        resumed = train.resumed_rollout_id if train is not None else None
        self.resumed = resumed is not None
        self.start = start if start is not None else 0 if resumed is None else resumed + 1
        self.version = self.start
        self._trained_at: float | None = None
        """When the last train call returned (the trainer's wait for the next is measured from it)."""
        """The trainer's weight version: the number of rollouts trained."""

    def run(self) -> None:
        if self.train is not None and self.resumed:
            self.source.restore(self.train.resumed_data_state)
            logger.info(
                "resumed after rollout %d (data position %s)", self.start - 1, self.train.resumed_data_state
            )
        if (
            self.train is not None and self.version
        ):  # resumed, or --start-rollout-id: the engines hold version 0
            self.push()
        if any(hook.before_loop(self) for hook in self.hooks):
            return
        started = None
        self._trained_at = time.perf_counter()  # slime's train_wait starts once the trainer is up
        for rollout_id in range(self.start, self.total):
            step = Step(rollout_id)
            with span(f"rollout {rollout_id}", "loop", "step"):
                if started != rollout_id:
                    self.source.start(rollout_id, self.version)
                step.rollout = self._wait(step, rollout_id)
                started = self._start_ahead(rollout_id)
                if self.train is not None:
                    self._train(step, ahead=started is not None)
                for hook in self.hooks:
                    hook.after_step(self, step)
        for hook in self.hooks:
            hook.after_loop(self)

    def _start_ahead(self, rollout_id: int) -> int | None:
        """Start the next rollout now, while this one trains, if the schedule says so."""
        nxt = rollout_id + 1
        if self.train is None or not self.schedule.lookahead or nxt >= self.total:
            return None
        self.source.start(nxt, self.version)
        return nxt

    def _train(self, step: Step, ahead: bool) -> None:
        assert self.train is not None and step.rollout is not None
        if not step.rollout.replayed:
            self.schedule.check_staleness(step.rollout, self.version)
        with step.timed("colocate"):
            if self.engines is not None and not ahead:  # never while a generation runs on them
                with step.timed("rollout_offload", part=True):
                    self.engines.release_memory()
            with step.timed("wake_up", part=True):
                self.train.wake()
        t0 = time.perf_counter()
        with span("train", "loop", rollout_id=step.rollout_id):
            step.output = self.train.train(step.rollout)
        step.train_call = time.perf_counter() - t0
        if self._trained_at is not None:
            step.train_wait = t0 - self._trained_at
        self._trained_at = t0 + step.train_call
        self.version += 1  # the trainer's weights now (a restarted engine given them while waiting gets this)
        for hook in self.hooks:
            hook.after_train(self, step)
        if (step.rollout_id + 1) % self.push_interval:
            return  # --update-weights-interval: the engines keep the weights they have
        if ahead:
            self._wait(step, step.rollout_id + 1)  # the engines must be idle before the push
        with step.timed("push"):
            step.push_stats = self.push(step)

    def push(self, step: Step | None = None) -> dict[str, Any]:
        """The weights of `version` into the engines; colocated engines take their memory back
        in two halves (weights before, KV cache after), with --offload the trainer gives its up.
        `step`: the step whose parts are timed (the trainer's sleep, the engines' onload, the
        transfer).

        Engines restarted after a fault (--use-fault-tolerance) are pushed to with the others and
        admitted after it; an engine that fails during the push is marked down, and the push is
        done again on the engines left (with none left, it waits for a restart)."""
        if self.train is None or self.engines is None:
            return {}
        self.phase("push", version=self.version, engines=self.engines.up_urls())
        timed = step.timed if step is not None else lambda name, part: contextlib.nullcontext()
        with timed("sleep", True):
            self.train.sleep(keep_params=True)
        self.engines.pause_checks()  # a paused engine's /health_generate may time out
        try:
            for attempt in range(len(self.engines.urls) + 1):
                joining = self.engines.heal(wait=True)
                with timed("rollout_onload", True):
                    self.engines.resume_memory(WEIGHT_TAGS)  # may find an engine down: connect after it
                self.train.ensure_connected(self.engines)
                try:
                    with timed("update_weights", True):
                        stats = self.train.push_weights(self.version)
                    break
                except Exception as e:
                    if not self._engine_fault(e) or attempt == len(self.engines.urls):
                        raise
        finally:
            self.engines.resume_checks()
        with timed("sleep", True):
            self.train.sleep()
        with timed("rollout_onload", True):
            self.engines.resume_memory(CACHE_TAGS)
        self.engines.admit(joining)
        return stats

    def _engine_fault(self, e: Exception) -> bool:
        """After a failed push: True when an engine died (the push can go again without it)."""
        assert self.train is not None and self.engines is not None
        if isinstance(e, TrainRankDied):
            return False
        down = self.engines.probe()
        moved = not self.train.connected_to(self.engines)  # an engine left since the bridge was built
        if not down and not moved:
            return False
        cause = getattr(e, "cause", None) or e  # a Ray task error's original exception
        logger.warning(
            "the push of version %d failed (%s): engines %s are down; pushing again to the others",
            self.version,
            cause,
            sorted(down) or "found down before it",
        )
        return True

    def heal(self) -> None:
        """While waiting for a generation (the trainer is idle): engines restarted after a fault get
        the current weights and take requests again (--use-fault-tolerance)."""
        if self.engines is None:
            return
        joining = self.engines.heal()
        if not joining:
            return
        if self.train is not None:
            self.train.sleep(keep_params=True)  # --offload: the parameters back on the device
            try:
                self.train.connect(self.engines, only=joining)
                self.train.push_weights(self.version)
            except Exception as e:
                if isinstance(e, TrainRankDied) or not self.engines.probe():
                    raise
                logger.warning(
                    "pushing to restarted engines %s failed (%s); the ones down start again", joining, e
                )
                return
            finally:
                self.train.sleep()
        self.engines.admit(joining)

    def _wait(self, step: Step, rollout_id: int) -> Rollout:
        t0 = time.perf_counter()
        with span("wait_generate", "loop", rollout_id=rollout_id):
            rollout = self.source.wait(rollout_id)
        step.waited += time.perf_counter() - t0
        if self.engines is not None:
            self.phase("rollout_done", rollout_id=rollout_id, engines=self.engines.up_urls())
        return rollout
