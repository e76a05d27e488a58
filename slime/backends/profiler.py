"""--use-pytorch-profiler on a policy train rank: torch.profiler windows over chosen train calls
(slime.config.profile), written by slime.utils.profiling (a Chrome trace and an operator table).

Files, in --tensorboard-dir: `<target>_rank_<rank>.rollout_<rollout_id>.pt.trace.json.gz` and
`.txt`, one pair per profiled train call and target. With train_overall the log-prob passes and
the train steps are the ranges `train_log_probs` and `train_actor` in its trace (torch runs one
profiler at a time, so they get no window of their own then).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from slime.config.profile import ProfileConfig
from slime.utils.profiling import ProfileWindow


class TrainProfiler:
    def __init__(self, cfg: ProfileConfig, device_type: str, rank: int):
        self.cfg, self.device_type, self.rank = cfg, device_type, rank
        self.calls = 0
        """Train calls begun in this process (the first is 0)."""
        self._rollout: int | None = None
        """The rollout being profiled, while one is."""

    @contextlib.contextmanager
    def train_call(self, rollout_id: int) -> Iterator[None]:
        """One train call: profiled when its number is in [--profile-step-start, --profile-step-end)."""
        call, self.calls = self.calls, self.calls + 1
        if not self.cfg.profiles(call):
            yield
            return
        self._rollout = rollout_id
        try:
            with self._window("train_overall"):
                yield
        finally:
            self._rollout = None

    @contextlib.contextmanager
    def phase(self, target: str) -> Iterator[None]:
        """A phase of the train call (train_log_probs, train_actor): a window of its own when that
        target is asked for, a labelled range of train_overall's window when that one runs."""
        if self._rollout is None:
            yield
        elif "train_overall" in self.cfg.targets:
            import torch

            with torch.profiler.record_function(target):
                yield
        else:
            with self._window(target):
                yield

    @contextlib.contextmanager
    def _window(self, target: str) -> Iterator[None]:
        if target not in self.cfg.targets:
            yield
            return
        assert self.cfg.out_dir is not None, "slime.config.profile.profile_config sets it"
        window = ProfileWindow.start(self.device_type)
        try:
            yield
        finally:
            name = f"{target}_rank_{self.rank}.rollout_{self._rollout}"
            window.stop(os.path.join(self.cfg.out_dir, name))
