"""The three schedules of the loop on a long-tail workload: synchronous (train.py), one step off
(train_async.py) and continuous (train_async.py --fully-async), in one run.

    python benchmarks/bench_async.py [--num-rollout 20] [--warmup 4] [--lags 1,4]
        [--pause-modes retract,in_place] [--n-samples-per-prompt 2] [--out DIR]

The workload: the demo's model and prompts (one engine, one FSDP rank, tensor push), 8 prompts
x --n-samples-per-prompt samples per rollout, one optimizer step each, micro-batches by token
budget (--use-dynamic-batch-size: little padding). Each prompt carries the response length it
is generated to (the engine ignores EOS, through a custom generate function): 32 tokens for
most prompts, and for one prompt in eight 4-8x that (128-256 tokens), so a rollout's last
groups run long after the others. Each continuous run is one --max-policy-version-lag value
with one --pause-generation-mode.

Prints per schedule the mean seconds per step of each phase, the steps per minute after --warmup
steps, the trainer's idle share (the part of a step it waited for generation), the engine's idle
share (one minus its busy share: the seconds its forward steps took per wall second, from the
torch engine's `busy_seconds`), the policy lag and the stale groups of the continuous runs, the
mean response length and response tokens trained per minute (a tight bound drops or requeues
the long responses, which makes steps cheaper), and the ratios against one-step-off (target:
continuous >= 1.3x steps per minute).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import make_demo

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT = 32
"""The response length of most prompts; one in eight is drawn 4-8x longer."""
BATCH = 8
"""Prompts per rollout (one optimizer step per rollout)."""

PLUGIN = '''
from slime.rollout.sglang_rollout import generate as _generate


async def generate(args, sample, sampling_params):
    """Generate to the length the prompt carries (EOS ignored): the workload's long tail."""
    params = dict(sampling_params, max_new_tokens=int(sample.metadata["response_len"]), ignore_eos=True)
    return await _generate(args, sample, params)
'''


def make_workload(out: str, task: str, seed: int = 0) -> tuple[str, int]:
    """The task's prompts with a response length each; returns (prompt file, longest length)."""
    rng = random.Random(seed)
    path = os.path.join(out, "longtail.jsonl")
    longest = SHORT
    with open(os.path.join(task, "train.jsonl")) as src, open(path, "w") as dst:
        for line in src:
            row = json.loads(line)
            length = SHORT * rng.randint(4, 8) if rng.random() < 1 / 8 else SHORT
            longest = max(longest, length)
            dst.write(json.dumps({**row, "metadata": {"response_len": length}}) + "\n")
    with open(os.path.join(out, "longtail_plugin.py"), "w") as f:
        f.write(PLUGIN)
    return path, longest


def run(
    script: str,
    out: str,
    model: str,
    prompts: str,
    longest: int,
    num_rollout: int,
    n: int,
    tag: str,
    extra: tuple[str, ...],
) -> list[dict]:
    log_dir = os.path.join(out, "logs-" + tag)
    env = {
        **os.environ,
        "SLIME_LOG_DIR": log_dir,
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join([out, ROOT, os.environ.get("PYTHONPATH", "")]),
    }
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
        prompts,
        "--metadata-key",
        "metadata",
        "--rollout-shuffle",
        "--rm-type",
        "exact",
        "--custom-generate-function-path",
        "longtail_plugin.generate",
        "--num-rollout",
        str(num_rollout),
        "--rollout-batch-size",
        str(BATCH),
        "--n-samples-per-prompt",
        str(n),
        "--rollout-max-response-len",
        str(longest),
        "--global-batch-size",
        str(BATCH * n),
        "--use-dynamic-batch-size",
        "--max-tokens-per-gpu",
        "2048",
        "--lr",
        "5e-4",
        "--update-weight-transport",
        "tensor",
        "--seed",
        "1",
        *extra,
    ]
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=out)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{tag} failed with exit code {proc.returncode}")
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "time/step" in r]


def summarize(records: list[dict], warmup: int, n: int) -> dict[str, float]:
    steady = records[warmup:]

    def mean(key: str) -> float:
        values = [r[key] for r in steady if key in r]
        return statistics.fmean(values) if values else float("nan")

    step = mean("time/step")
    return {
        "generate": mean("time/generate"),
        "wait_generate": mean("time/wait_generate"),
        "log_probs": mean("time/log_probs"),
        "train": mean("time/train"),
        "push": mean("time/push"),
        "step": step,
        "steps_per_min": 60.0 * len(steady) / sum(r["time/step"] for r in steady),
        "trainer_idle": mean("time/wait_generate") / step,
        "engine_idle": 1.0 - mean("time/engine_busy_share"),
        "lag_mean": mean("rollout/policy_lag_mean"),
        "lag_max": max((r.get("rollout/policy_lag_max", 0.0) for r in steady), default=0.0),
        "stale": sum(
            r.get("rollout/stale_groups_requeued", 0.0) + r.get("rollout/stale_groups_dropped", 0.0)
            for r in steady
        ),
        "response_len": mean("rollout/response_length_mean"),
        "tokens_per_min": 60.0
        * sum(r["rollout/response_length_mean"] * BATCH * n for r in steady)
        / sum(r["time/step"] for r in steady),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-rollout", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4, help="first steps left out of the means")
    parser.add_argument(
        "--lags", default="1,4", help="--max-policy-version-lag values of the continuous runs"
    )
    parser.add_argument(
        "--n-samples-per-prompt", type=int, default=2, help="samples per prompt (8 prompts per rollout)"
    )
    parser.add_argument(
        "--pause-modes", default="retract,in_place", help="--pause-generation-mode of the continuous runs"
    )
    parser.add_argument("--out", default=None, help="where models, data and logs go (default: a temp dir)")
    args = parser.parse_args()
    if args.num_rollout <= args.warmup:
        parser.error("--num-rollout must be larger than --warmup")
    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="bench-async-"))
    os.makedirs(out, exist_ok=True)
    model, task = make_demo(out)
    prompts, longest = make_workload(out, task)
    schedules: dict[str, tuple[str, tuple[str, ...]]] = {
        "synchronous": ("train.py", ()),
        "one-step-off": ("train_async.py", ()),
    }
    for lag in args.lags.split(","):
        for mode in args.pause_modes.split(","):
            schedules[f"continuous N={lag} {mode}"] = (
                "train_async.py",
                ("--fully-async", "--max-policy-version-lag", lag, "--pause-generation-mode", mode),
            )
    results = {}
    for name, (script, extra) in schedules.items():
        tag = name.replace(" ", "-").replace("=", "")
        results[name] = summarize(
            run(
                script, out, model, prompts, longest, args.num_rollout, args.n_samples_per_prompt, tag, extra
            ),
            args.warmup,
            args.n_samples_per_prompt,
        )

    print(
        f"long-tail workload (response {SHORT} tokens, 1 prompt in 8 4-8x longer), {args.num_rollout} "
        f"rollouts per schedule, means over steps {args.warmup + 1}+; logs in {out}"
    )
    rows = [
        ("generate (s/step)", "generate", "{:.3f}"),
        ("waited for generation", "wait_generate", "{:.3f}"),
        ("log-probs", "log_probs", "{:.3f}"),
        ("train", "train", "{:.3f}"),
        ("push", "push", "{:.3f}"),
        ("step", "step", "{:.3f}"),
        ("steps per minute", "steps_per_min", "{:.1f}"),
        ("trainer idle share", "trainer_idle", "{:.0%}"),
        ("engine idle share", "engine_idle", "{:.0%}"),
        ("policy lag mean / max", None, ""),
        ("stale groups (requeued)", "stale", "{:.0f}"),
        ("mean response tokens", "response_len", "{:.1f}"),
        ("response tokens trained/min", "tokens_per_min", "{:.0f}"),
    ]
    width = max(len(n) for n in results) + 2
    print(f"{'':<24}" + "".join(f"{n:>{width}}" for n in results))
    for label, key, fmt in rows:
        if key is None:
            cells = [
                f"{r['lag_mean']:.2f} / {r['lag_max']:.0f}" if r["lag_mean"] == r["lag_mean"] else "-"
                for r in results.values()
            ]
        else:
            cells = [fmt.format(r[key]) if r[key] == r[key] else "-" for r in results.values()]
        print(f"{label:<24}" + "".join(f"{c:>{width}}" for c in cells))
    base = results["one-step-off"]["steps_per_min"]
    for name, r in results.items():
        if name != "one-step-off":
            print(f"{name} / one-step-off = {r['steps_per_min'] / base:.2f}x steps per minute")
    print("(target: continuous >= 1.3x one-step-off)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
