"""bench_grpo_step.py --profile: one more rollout at the end of the job, profiled (the medians
leave it out), writing operator tables and Chrome traces to <out>/profile:

- the trainer's whole train call (train.py --use-pytorch-profiler, train_overall): the log-prob
  pass and the train steps are the ranges `train_log_probs` and `train_actor` in its trace;
- the engine's decode steps (SGLang's /start_profile on the job's engines): `engine_hook`, the
  job's --debug-phase-hook, asks each engine once the last measured rollout is generated for a
  window of up to 32 steps opening up to 16 steps later, past the profiled rollout's prefills (a
  half and a quarter of --max-new-tokens where those are fewer).
"""

from __future__ import annotations

import json
import os
import urllib.request
from typing import Any

ENV = "SLIME_BENCH_PROFILE"
"""The hook's settings, as JSON, from the benchmark to the job's driver."""


def job_flags(out: str, steps: int, max_new_tokens: int) -> tuple[list[str], dict[str, str]]:
    """train.py's flags and environment for a job of `steps` measured rollouts and the profiled one."""
    flags = [
        "--use-pytorch-profiler",
        "--profile-step-start",
        str(steps),
        "--profile-step-end",
        str(steps + 1),
        "--tensorboard-dir",
        os.path.join(out, "profile"),
        "--debug-phase-hook",
        "benchmarks.step_profile.engine_hook",
    ]
    settings = {
        "out": os.path.join(out, "profile"),
        "after_rollout": steps - 1,
        "skip": min(16, max(1, max_new_tokens // 4)),
        "steps": min(32, max(1, max_new_tokens // 2)),
    }
    # the engines may write profiles under this directory only (slime.engines.torch_engine.profile_api)
    return flags, {ENV: json.dumps(settings), "SGLANG_TORCH_PROFILER_DIR": settings["out"]}


def engine_hook(phase: str, info: dict[str, Any]) -> None:
    """--debug-phase-hook: at the last measured rollout's end, the engines' windows asked for."""
    settings = json.loads(os.environ[ENV])
    if phase != "rollout_done" or info["rollout_id"] != settings["after_rollout"]:
        return
    for i, url in enumerate(info["engines"]):
        with urllib.request.urlopen(f"{url}/server_info", timeout=30) as r:
            steps = int(json.load(r)["internal_states"][0]["num_steps"])
        body = {
            "profile_prefix": f"engine{i}",
            "start_step": steps + settings["skip"],
            "num_steps": settings["steps"],
            "record_shapes": True,
            "with_stack": False,
        }
        request = urllib.request.Request(
            f"{url}/start_profile", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        urllib.request.urlopen(request, timeout=30).close()


def print_tables(out: str, rows: int = 25) -> None:
    """Each table's head, so that the benchmark's output names the expensive operators."""
    folder = os.path.join(out, "profile")
    tables = sorted(f for f in os.listdir(folder) if f.endswith(".txt")) if os.path.isdir(folder) else []
    if not tables:
        print(f"\nprofile: no table written in {folder}")
    for name in tables:
        with open(os.path.join(folder, name)) as f:
            lines = f.read().splitlines()
        print(f"\nprofile {name} (traces beside it):")
        print("\n".join(lines[: rows + 4]))
