"""Step-time breakdown of the RL loop, and train_async.py against train.py, on the demo workload.

    python benchmarks/bench_loop.py [--num-rollout 40] [--warmup 5] [--out DIR]

Builds the demo's model and task (scripts/run-tiny-cpu.sh, without the SFT phase: the base model
is enough to time the loop), then runs train.py and train_async.py with the same flags (one
engine, one FSDP rank, tensor push; 16 prompts x 16 samples per rollout). On this workload
generation and training take similar time, the case train_async.py is for.

Prints, per schedule, the mean seconds per step of each phase with its share of the step (the
idle/orchestration share is what no component measured: Ray calls, scheduling, waiting), the
steps per minute after --warmup steps, and the ratio async / sync (target >= 1.4).

Then the cost of the job's timeline: train.py again with --trace-dir, its mean step time against
the untraced run's, and the driver's drain of the processes' events after each step (the part of
tracing on the step's path, read from the trace itself) as a share of the step (target <= 2%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ["generate", "wait_generate", "log_probs", "train", "push", "colocate", "eval", "save", "idle"]


def run(
    script: str, out: str, model: str, task: str, num_rollout: int, extra: tuple[str, ...] = (), tag: str = ""
) -> list[dict]:
    log_dir = os.path.join(out, script.removesuffix(".py") + tag)
    env = {**os.environ, "SLIME_LOG_DIR": log_dir, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    argv = [
        sys.executable,
        os.path.join(ROOT, script),
        "--hf-checkpoint",
        model,
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-num-gpus",
        "1",
        "--prompt-data",
        os.path.join(task, "train.jsonl"),
        "--rollout-shuffle",
        "--rm-type",
        "exact",
        "--num-rollout",
        str(num_rollout),
        "--rollout-batch-size",
        "16",
        "--n-samples-per-prompt",
        "16",
        "--rollout-max-response-len",
        "4",
        "--global-batch-size",
        "64",
        "--micro-batch-size",
        "64",
        "--lr",
        "5e-4",
        "--update-weight-transport",
        "tensor",
        *extra,
    ]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{script} failed with exit code {proc.returncode}")
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "time/step" in r]


def summarize(records: list[dict], warmup: int) -> dict[str, float]:
    steady = records[warmup:]
    out = {p: statistics.fmean(r.get(f"time/{p}", 0.0) for r in steady) for p in PHASES}
    out["step"] = statistics.fmean(r["time/step"] for r in steady)
    out["steps_per_min"] = 60.0 * len(steady) / sum(r["time/step"] for r in steady)
    return out


def make_demo(out: str) -> tuple[str, str]:
    """The demo's base model and task under `out`: (model dir, task dir)."""
    model, task = os.path.join(out, "model"), os.path.join(out, "task")
    py = sys.executable
    subprocess.run(
        [
            py,
            "-m",
            "slime.tools.make_tiny_model",
            "--out",
            model,
            "--hidden-size",
            "128",
            "--num-layers",
            "4",
            "--num-heads",
            "4",
            "--num-kv-heads",
            "2",
        ],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    subprocess.run(
        [py, "-m", "slime.tools.make_demo_task", "--out", task], check=True, capture_output=True, cwd=ROOT
    )
    return model, task


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-rollout", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of the means")
    parser.add_argument("--out", default=None, help="where models, data and logs go (default: a temp dir)")
    args = parser.parse_args()
    if args.num_rollout <= args.warmup:
        parser.error("--num-rollout must be larger than --warmup")
    out = args.out or tempfile.mkdtemp(prefix="bench-loop-")
    model, task = make_demo(out)
    results = {
        s: summarize(run(s, out, model, task, args.num_rollout), args.warmup)
        for s in ("train.py", "train_async.py")
    }

    print(f"demo workload, {args.num_rollout} rollouts per schedule, means over steps {args.warmup + 1}+")
    print(f"{'phase (s/step)':<18}" + "".join(f"{s:>22}" for s in results))
    for p in [*PHASES, "step"]:
        cells = "".join(f"{r[p]:>12.3f} ({100 * r[p] / r['step']:>5.1f}%)" for r in results.values())
        print(f"{p:<18}{cells}")
    traced = tracing_cost(out, model, task, args.num_rollout, args.warmup, results["train.py"]["step"])
    sync, off = results["train.py"]["steps_per_min"], results["train_async.py"]["steps_per_min"]
    print(f"{'steps/min':<18}{sync:>22.1f}{off:>22.1f}")
    print(
        f"idle share: sync {100 * results['train.py']['idle'] / results['train.py']['step']:.1f}%, async "
        f"{100 * results['train_async.py']['idle'] / results['train_async.py']['step']:.1f}% (target < "
        "10%)"
    )
    print(f"train_async / train = {off / sync:.2f}x steps per minute (target >= 1.4x)")
    print("(generate runs concurrently with training in train_async.py: its share there is not on the")
    print(" critical path; wait_generate is the part of it the step waited for)")
    print(traced)
    return 0


def tracing_cost(out: str, model: str, task: str, num_rollout: int, warmup: int, untraced_step: float) -> str:
    """train.py with --trace-dir: its step time against `untraced_step`, and its drains' share."""
    trace_dir = os.path.join(out, "trace")
    records = run("train.py", out, model, task, num_rollout, ("--trace-dir", trace_dir), tag="-traced")
    step = summarize(records, warmup)["step"]
    (name,) = os.listdir(trace_dir)
    with open(os.path.join(trace_dir, name)) as f:
        events = json.load(f)["traceEvents"]
    drains = [e["dur"] / 1e6 for e in events if e.get("name") == "drain timeline"][warmup:]
    drain = statistics.fmean(drains) if drains else 0.0
    return "\n".join(
        [
            f"tracing (--trace-dir, train.py): {step:.3f} s/step traced, {untraced_step:.3f} untraced: "
            f"{100 * (step - untraced_step) / untraced_step:+.1f}% (two runs: their noise included)",
            f"tracing on the step's path (the driver's drain, from the trace): {1e3 * drain:.1f} ms/step = "
            f"{100 * drain / step:.2f}% of the step (target <= 2%)",
        ]
    )


if __name__ == "__main__":
    raise SystemExit(main())
