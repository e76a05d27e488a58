"""Learning under the continuous schedule: the demo task trained synchronously (train.py) and
continuously (train_async.py --fully-async) with --max-policy-version-lag 1 and 4, held-out
accuracy against the samples trained on.

    python benchmarks/bench_async_learning.py [--num-rollout 150] [--lags 1,4] [--out DIR]
        [--plot docs/images/async_learning.png]

Builds the demo as scripts/run-tiny-cpu.sh does (the tiny model, the addition task, the short SFT
warm start), then runs GRPO with the demo's flags under each schedule from the same SFT model and
seed. Prints held-out accuracy (greedy, 200 problems never trained on) at every evaluation, the
seconds each run took, and the lag each continuous run trained at; writes the plot.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES_PER_ROLLOUT = 16 * 16


def build(out: str, seed: int) -> tuple[str, str]:
    """The demo's SFT model and task under `out`."""
    py = sys.executable
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TOKENIZERS_PARALLELISM": "false"}
    base, task, sft = (os.path.join(out, d) for d in ("base", "task", "sft"))
    for argv in (
        [
            "-m",
            "slime.tools.make_tiny_model",
            "--out",
            base,
            "--hidden-size",
            "128",
            "--num-layers",
            "4",
            "--num-heads",
            "4",
            "--num-kv-heads",
            "2",
            "--seed",
            str(seed),
        ],
        ["-m", "slime.tools.make_demo_task", "--out", task, "--seed", "0"],
        [
            "-m",
            "slime.tools.sft",
            "--hf-checkpoint",
            base,
            "--data",
            os.path.join(task, "sft.jsonl"),
            "--save-hf",
            sft,
            "--num-epoch",
            "30",
            "--lr",
            "2e-3",
            "--global-batch-size",
            "30",
            "--micro-batch-size",
            "30",
            "--seed",
            str(seed),
        ],
    ):
        subprocess.run([py, *argv], check=True, capture_output=True, cwd=ROOT, env=env)
    return sft, task


def run(
    script: str,
    out: str,
    tag: str,
    model: str,
    task: str,
    num_rollout: int,
    seed: int,
    extra: tuple[str, ...],
) -> tuple[list[dict], float]:
    log_dir = os.path.join(out, "logs-" + tag)
    env = {**os.environ, "SLIME_LOG_DIR": log_dir, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    argv = [
        sys.executable,
        os.path.join(ROOT, script),
        "--hf-checkpoint",
        model,
        "--device",
        "cpu",
        "--actor-num-gpus-per-node",
        "1",
        "--rollout-num-gpus",
        "1",
        "--prompt-data",
        os.path.join(task, "train.jsonl"),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
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
        "--rollout-temperature",
        "1.0",
        "--advantage-estimator",
        "grpo",
        "--global-batch-size",
        "64",
        "--micro-batch-size",
        "64",
        "--lr",
        "5e-4",
        "--lr-warmup-iters",
        str(min(10, num_rollout)),
        "--lr-decay-style",
        "cosine",
        "--lr-decay-iters",
        str(num_rollout * 4),
        "--min-lr",
        "5e-5",
        "--eval-interval",
        "25",
        "--eval-prompt-data",
        os.path.join(task, "eval.jsonl"),
        "--eval-temperature",
        "0",
        "--seed",
        str(seed),
        "--update-weight-transport",
        "tensor",
        *extra,
    ]
    start = time.monotonic()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
    seconds = time.monotonic() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{tag} failed with exit code {proc.returncode}")
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return list(map(json.loads, f)), seconds


def plot(curves: dict[str, list[tuple[int, float]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for name, points in curves.items():
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o", markersize=3, label=name)
    ax.set_xlabel("samples trained on")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title("demo task: synchronous vs continuous (--max-policy-version-lag N)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-rollout", type=int, default=150)
    parser.add_argument("--lags", default="1,4")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default=None, help="where models, data and logs go (default: a temp dir)")
    parser.add_argument("--plot", default=None, help="PNG path (default: OUT/async_learning.png)")
    args = parser.parse_args()
    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="bench-async-learning-"))
    os.makedirs(out, exist_ok=True)
    model, task = build(out, args.seed)
    schedules: dict[str, tuple[str, tuple[str, ...]]] = {"synchronous": ("train.py", ())}
    for lag in args.lags.split(","):
        schedules[f"continuous N={lag}"] = (
            "train_async.py",
            ("--fully-async", "--max-policy-version-lag", lag),
        )
    curves: dict[str, list[tuple[int, float]]] = {}
    summary: dict[str, str] = {}
    for name, (script, extra) in schedules.items():
        tag = name.replace(" ", "").replace("=", "")
        records, seconds = run(script, out, tag, model, task, args.num_rollout, args.seed, extra)
        # eval at step s ran after s rollouts were trained on (step 0: before any)
        curves[name] = [
            (int(r["step"]) * SAMPLES_PER_ROLLOUT, r["eval/accuracy"])
            for r in records
            if "eval/accuracy" in r
        ]
        lags = [r["rollout/policy_lag_mean"] for r in records if "rollout/policy_lag_mean" in r]
        stale = sum(r.get("rollout/stale_groups_requeued", 0.0) for r in records)
        summary[name] = f"{seconds:.0f} s" + (
            f", lag mean {sum(lags) / len(lags):.2f}, {stale:.0f} groups requeued" if lags else ""
        )
    points = sorted({x for c in curves.values() for x, _ in c})
    print(
        f"held-out accuracy by samples trained on ({args.num_rollout} rollouts of {SAMPLES_PER_ROLLOUT} "
        "samples)"
    )
    print(f"{'samples':>8}" + "".join(f"{n:>18}" for n in curves))
    for x in points:
        cells = [dict(c).get(x) for c in curves.values()]
        print(f"{x:>8}" + "".join(f"{v:>18.3f}" if v is not None else f"{'-':>18}" for v in cells))
    for name, text in summary.items():
        print(f"{name}: {text}")
    path = args.plot or os.path.join(out, "async_learning.png")
    plot(curves, path)
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
