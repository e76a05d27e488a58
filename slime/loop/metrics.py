"""The last hook of a step: one metrics record (rollout, trainer, push, time breakdown) to the
tracker, the progress bar and the log."""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from slime.loop.core import Hook, Loop
from slime.loop.hooks import short_summary
from slime.loop.parts import Step

logger = logging.getLogger(__name__)


class Sink(Protocol):
    steps_per_rollout: int | None

    def log(self, record: dict[str, Any], step: int) -> None: ...


class ProgressBar(Protocol):
    def step(self, summary: str) -> None: ...


class Metrics(Hook):
    """Writes each step's record; `step` counts rollouts trained (the eval before training is 0)."""

    def __init__(self, sink: Sink, progress: ProgressBar | None = None, train_steps: bool = False):
        """`train_steps` (--wandb-always-use-train-step): the sink counts optimizer steps, its
        `steps_per_rollout` set from the trained rollouts."""
        self.sink, self.progress, self.train_steps = sink, progress, train_steps

    def after_step(self, loop: Loop, step: Step) -> None:
        assert step.rollout is not None
        record: dict[str, Any] = {"rollout_id": step.rollout_id}
        if step.output is None:  # --debug-rollout-only: the rollout's own metrics
            record.update(step.rollout.metrics)
            record.update(step.record)
            record["time/step"] = time.perf_counter() - step.started
            mode = " (rollout only)"
        else:
            record.update(train_record(step, loop.schedule.lookahead > 0))
            mode = ""
            if self.train_steps and step.output.steps and self.sink.steps_per_rollout is None:
                self.sink.steps_per_rollout = len(
                    step.output.steps
                )  # the first rollout's: steps never go back
        self.sink.log(record, step.rollout_id + 1)
        summary = short_summary(record)
        if self.progress is not None:
            self.progress.step(summary)
        logger.info("rollout %d/%d%s %s", step.rollout_id + 1, loop.total, mode, summary)


def train_record(step: Step, ahead: bool) -> dict[str, Any]:
    """A trained step's record. time/*: what the driver timed, the ranks' own log-prob and train
    time, and `idle` = the step minus the work on its critical path (Ray calls, scheduling)."""
    assert step.rollout is not None and step.output is not None
    output, metrics = step.output, step.rollout.metrics
    record: dict[str, Any] = {k: v for k, v in metrics.items() if k != "time/generate"}
    # The trainer's token means: log_probs, ref_log_probs, rollout_log_probs, kl, and
    # train_rollout_logprob_abs_diff (trainer vs engine).
    record.update({f"rollout/{k}": v for k, v in output.rollout.items()})
    record["push/bytes"] = step.push_stats.get("bytes", 0.0)
    if "transport" in step.push_stats:  # the transport as it ran (shared_memory, cuda_ipc, ...)
        record["push/transport"] = step.push_stats["transport"]
    record.update({f"train/{k}": v for k, v in (output.steps[-1] if output.steps else {}).items()})
    record.update({f"perf/{k}": v for k, v in output.perf.items()})  # train rank 0's (slime's perf/*)
    record.update({f"perf/{k}_time": v for k, v in step.parts.items()})  # parts of the phases below
    if step.train_wait is not None:  # slime's: how long the trainer waited, against its train calls
        record["perf/train_wait_time"], record["perf/train_time"] = step.train_wait, step.train_call
        record["perf/step_time"] = step.train_wait + step.train_call
        record["perf/wait_time_ratio"] = (
            step.train_wait / record["perf/step_time"] if record["perf/step_time"] else 0.0
        )
    record.update(step.record)
    inside = {f"time/{k}": v for k, v in output.timings.items()}
    inside.setdefault("time/log_probs", 0.0)
    inside.setdefault("time/train", 0.0)
    inside["time/train_call_overhead"] = max(
        0.0, step.train_call - inside["time/log_probs"] - inside["time/train"]
    )
    # Synchronously the step waited for all of the generation; one step off only for what
    # training did not hide.
    generate_on_path = step.waited if ahead else metrics.get("time/generate", 0.0)
    elapsed = time.perf_counter() - step.started
    work = generate_on_path + sum(step.phases.values()) + inside["time/log_probs"] + inside["time/train"]
    record.update({f"time/{k}": v for k, v in step.phases.items()})
    record.update(inside)
    record["time/step"] = elapsed
    record["time/idle"] = max(0.0, elapsed - work)
    record["time/idle_ratio"] = record["time/idle"] / elapsed if elapsed > 0 else 0.0
    record["time/generate"] = metrics.get("time/generate", 0.0)
    record["time/wait_generate"] = step.waited
    return record
