"""Waiting on Ray: results that fail fast, a progress bar that names the running phase."""

from __future__ import annotations

import time
from typing import Any

import ray


def wait_refs(refs: Any, timeout_s: float | None = None, poll: Any = None) -> Any:
    """ray.get(refs) (a plain value is returned as is), but a result that is an error is raised
    as soon as it arrives, not after the others (a rank that failed may leave its peers waiting
    for it forever); TimeoutError after `timeout_s`. `poll()` runs every half second."""
    if not isinstance(refs, list | ray.ObjectRef):
        return refs
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = refs if isinstance(refs, list) else [refs]
    while True:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
        ray.get(ready)  # raises the first failure among those done
        if not pending:
            return ray.get(refs)
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError
        if poll is not None:
            poll()


class RolloutBar:
    """A tqdm bar over the rollouts whose postfix names the running phase (and, while
    generating, the samples done). Off when stderr is not a terminal: logs get one line per step."""

    def __init__(self, total: int, initial: int, manager: Any):
        from tqdm import tqdm

        self.manager = manager
        self.bar = tqdm(total=total, initial=initial, desc="rollouts", unit="step", disable=None, leave=True)

    def wait(self, refs: Any, phase: str, timeout_s: float | None = None, idle: Any = None) -> Any:
        """wait_refs(refs), showing `phase` on the bar meanwhile; `idle()` runs every half second."""
        if self.bar.disable:
            return wait_refs(refs, timeout_s, idle)
        self.bar.set_postfix_str(phase)

        def poll() -> None:
            if phase == "generate" and self.manager is not None:
                done, total = ray.get(self.manager.progress_counts.remote())
                self.bar.set_postfix_str(f"generate {done}/{total} samples")
            if idle is not None:
                idle()

        return wait_refs(refs, timeout_s, poll)

    def step(self, summary: str) -> None:
        self.bar.update(1)
        self.bar.set_postfix_str(summary)

    def close(self) -> None:
        self.bar.close()
