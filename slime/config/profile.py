"""--use-pytorch-profiler: torch.profiler windows on the train ranks (slime.backends.profiler),
with slime's and Megatron-LM's flag names."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from slime.config.flags import flag, from_flags

TARGETS = ("train_overall", "train_actor", "train_log_probs")


@dataclass(frozen=True)
class ProfileConfig:
    enabled: bool = flag("--use-pytorch-profiler", False)
    """profile every policy train rank with torch.profiler over the train calls numbered
    [--profile-step-start, --profile-step-end) of this run (counted from 0, the first rollout this
    process trains): per window a Chrome trace and a table of the most expensive operators in
    --tensorboard-dir (docs/debugging.md, Profiling)"""
    step_start: int = flag("--profile-step-start", 10)
    """the first train call profiled (Megatron-LM's default)"""
    step_end: int = flag("--profile-step-end", 12)
    """the first train call no longer profiled"""
    targets: tuple[str, ...] = flag("--profile-target", ["train_overall"], nargs="+", choices=TARGETS)
    """train_overall: the whole train call, one window (its log-prob passes and its train steps
    are labelled ranges in it); train_log_probs / train_actor: a window of that phase alone"""
    out_dir: str | None = flag("--tensorboard-dir", None, metavar="DIR")
    """where the profiler writes (Megatron-LM's TensorBoard directory, as slime's profiler uses
    it; the metrics' TensorBoard directory is --tb-dir); default: <log dir>/profile, the log
    directory being SLIME_LOG_DIR or <--save or .>/logs"""

    def __post_init__(self) -> None:
        if self.enabled and self.out_dir is None:
            raise ValueError("--use-pytorch-profiler needs --tensorboard-dir (where its traces go)")
        if self.enabled and not 0 <= self.step_start < self.step_end:
            raise ValueError(
                f"--profile-step-start {self.step_start} / --profile-step-end {self.step_end}: the "
                "profiled train calls are [start, end), so 0 <= start < end"
            )

    def profiles(self, call: int) -> bool:
        """Whether train call `call` (from 0) is profiled."""
        return self.enabled and self.step_start <= call < self.step_end


def log_directory(save: str | None) -> str:
    """The job's log directory: SLIME_LOG_DIR, else <--save or .>/logs."""
    return os.environ.get("SLIME_LOG_DIR") or os.path.join(save or ".", "logs")


def profile_config(ns: argparse.Namespace) -> ProfileConfig:
    if not hasattr(ns, "use_pytorch_profiler"):  # a parser without these flags (tools, tests)
        return ProfileConfig()
    out = ns.tensorboard_dir or os.path.join(log_directory(getattr(ns, "save", None)), "profile")
    return from_flags(ProfileConfig, ns, out_dir=os.path.abspath(out))
