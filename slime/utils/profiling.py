"""torch.profiler windows, for the trainer (--use-pytorch-profiler) and the torch engine
(/start_profile): each window leaves a Chrome trace and a table of its most expensive operators.

    window = ProfileWindow.start(device_type, record_shapes=True)
    ...                                   # the work to profile, on this thread
    paths = window.stop("/out/train_overall_rank_0.rollout_10")
    # -> .../train_overall_rank_0.rollout_10.pt.trace.json.gz (chrome://tracing, Perfetto,
    #    TensorBoard's profiler plugin) and .../train_overall_rank_0.rollout_10.txt

The table is what a person reads first: torch's key_averages, most expensive first by the
device's own time where a GPU was profiled (by the host's on a CPU run), with each operator's
share of the window, so a slow step names its kernels without a trace viewer.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from slime.utils.files import atomic_write_text

logger = logging.getLogger(__name__)

ROWS = 40
"""Operators in a window's table."""


def activities(device_type: str, names: list[str] | None = None) -> list[Any]:
    """torch.profiler's activities: the host's, and the device's on CUDA. `names` (SGLang's
    /start_profile field: "CPU", "GPU"; others are not built here) picks among them."""
    import torch

    wanted = {n.upper() for n in names} if names else {"CPU", "GPU"}
    unknown = wanted - {"CPU", "GPU", "CUDA"}
    if unknown:
        raise ValueError(f"activities {sorted(unknown)}: only CPU and GPU are profiled here")
    chosen = []
    if "CPU" in wanted:
        chosen.append(torch.profiler.ProfilerActivity.CPU)
    if wanted & {"GPU", "CUDA"} and device_type == "cuda":
        chosen.append(torch.profiler.ProfilerActivity.CUDA)
    if not chosen:
        raise ValueError("activities: nothing to profile (GPU alone on a run without a GPU)")
    return chosen


@dataclass
class ProfileWindow:
    """One running torch.profiler.profile, started and stopped on the thread doing the work."""

    profile: Any
    device_type: str
    started: float

    @classmethod
    def start(
        cls,
        device_type: str,
        names: list[str] | None = None,
        record_shapes: bool = True,
        with_stack: bool = False,
    ) -> ProfileWindow:
        import torch

        profile = torch.profiler.profile(
            activities=activities(device_type, names),
            record_shapes=record_shapes,
            with_stack=with_stack,
            with_flops=True,
        )
        profile.start()
        return cls(profile, device_type, time.perf_counter())

    def stop(self, prefix: str, trace_suffix: str = ".pt.trace.json.gz") -> list[str]:
        """Stop, then write `prefix` + `trace_suffix` (torch's own name by default) and
        `prefix`.txt, each whole under a temporary name first: a reader never sees half a file.
        Returns the two paths."""
        self.profile.stop()
        seconds = time.perf_counter() - self.started
        folder = os.path.dirname(os.path.abspath(prefix))
        os.makedirs(folder, exist_ok=True)
        trace, table = prefix + trace_suffix, f"{prefix}.txt"
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            partial = os.path.join(tmp, "trace.json.gz")  # (torch gzips a .gz name itself)
            self.profile.export_chrome_trace(partial)
            os.replace(partial, trace)
        atomic_write_text(table, self.table(seconds))
        logger.info("profile of %.2f s written: %s (table: %s)", seconds, trace, table)
        return [trace, table]

    def table(self, seconds: float) -> str:
        on_device = self.device_type == "cuda"
        sort_by = "self_device_time_total" if on_device else "self_cpu_time_total"
        events = self.profile.key_averages()
        whose = "the device" if on_device else "the host"
        head = f"{seconds:.3f} s profiled; most expensive first by {whose}'s own time ({sort_by})\n"
        return head + events.table(sort_by=sort_by, row_limit=ROWS, max_name_column_width=60) + "\n"
