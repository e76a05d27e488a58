"""Every benchmark in benchmarks/ keeps running: each with its smallest arguments, end to end, and
the line of its table that says it measured. The cheapest (bench_push) runs in the default suite
(which must stay under 10 minutes on two cores); the others, seconds to minutes each, with `-m slow`."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

VISION_ARGS = [
    "--requests",
    "2",
    "--new-tokens",
    "2",
    "--image-sizes",
    "64",
    "--hidden-size",
    "64",
    "--num-layers",
    "1",
    "--threads",
    "1",
]
# name: (smallest arguments, a line its table prints, slow)
BENCHMARKS: dict[str, tuple[list[str], str, bool]] = {
    "bench_push": (
        ["--hidden-size", "64", "--num-layers", "1", "--bucket-mb", "1", "--repeats", "1", "--threads", "1"],
        "tensor / copy =",
        False,
    ),
    "bench_weight_sync": (["--repeats", "1"], "overhead", True),
    "bench_vision": (
        VISION_ARGS,
        "| 64x64 (4 tokens) |",
        True,
    ),
    "bench_rollout_transfer": (
        ["--samples", "4", "--response-len", "8", "--ranks", "1"],
        "(bytes by value / by reference)",
        True,
    ),
    "bench_engine": (
        ["--threads", "1", "--leak-requests", "0", "--requests", "2"],
        "ratio torch engine / HF generate",
        True,
    ),
    "bench_grpo_step": (
        [
            "--device",
            "cpu",
            "--steps",
            "3",
            "--bandwidth-gbs",
            "20",
            "--peak-tflops",
            "1",
            "--hf-samples",
            "2",
            "--profile",
            "--torch-compile",
        ],
        "profile engine0-",  # after the table; the engine's window asked by the job's phase hook
        True,
    ),
    "bench_routing_replay": (
        ["--arch", "glm4_moe", "--threads", "1", "--requests", "1", "--new-tokens", "2"],
        "glm4_moe      | bfloat16 ",
        True,
    ),
    "bench_moe": (["--threads", "1", "--rollouts", "1"], "ratio MoE / dense, train tokens/s", True),
    "bench_train": (["--threads", "1", "--rollouts", "1"], "overhead ratio", True),
    "bench_packing": (
        [
            "--backends",
            "fsdp",
            "--workloads",
            "equal",
            "--batchings",
            "fixed",
            "--samples",
            "8",
            "--repeats",
            "1",
            "--threads",
            "1",
            "--skip-chunks",
        ],
        "packed/padded",
        True,
    ),
    "bench_lora": (
        ["--ranks", "1", "--rollouts", "1", "--train-backends", "megatron"],
        "megatron: model",
        True,
    ),
    "bench_megatron": (["--rollouts", "1"], "megatron", True),
    "bench_deterministic": (["--threads", "1", "--num-rollout", "4"], "deterministic / default =", True),
    "bench_loop": (["--num-rollout", "2", "--warmup", "0"], "train_async / train =", True),
    "bench_async": (
        ["--num-rollout", "2", "--warmup", "0", "--lags", "1", "--pause-modes", "retract"],
        "synchronous / one-step-off =",
        True,
    ),
    "bench_async_learning": (["--num-rollout", "2", "--lags", "1"], "plot: ", True),
    "bench_fault_tolerance": (
        ["--num-rollout", "3", "--warmup", "0", "--kill-at", "1"],
        "a kill at rollout 1",
        True,
    ),
    "bench_job_start": (["--repeats", "1", "--ranks", "1"], "ratio", True),
    "bench_delta_sync": (
        ["--shapes", "demo", "--pushes", "1", "--lrs", "1e-6", "--threads", "1"],
        "xor+zstd / full",
        True,
    ),
}
# Run by their own tests, with more to check: tests/test_bench_agent_adapter.py, tests/test_bench_families.py.
OWN_TESTS = ("bench_agent_adapter", "bench_families")


def test_every_benchmark_has_a_smoke_run():
    names = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "benchmarks", "bench_*.py"))}
    assert names == set(BENCHMARKS) | set(OWN_TESTS)


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[pytest.mark.slow] if slow else []) for n, (_, _, slow) in BENCHMARKS.items()],
)
def test_benchmark_runs_with_its_smallest_arguments(name):
    args, line, _ = BENCHMARKS[name]
    # The system's temporary directory: Ray's socket paths under pytest's would pass the AF_UNIX limit.
    proc = subprocess.run(
        [sys.executable, f"benchmarks/{name}.py", *args], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert line in proc.stdout, proc.stdout[-3000:]


def test_bench_engine_null_model_measures_this_tree_and_another():
    """`bench_engine.py --null-model`: the host's time per decode step, this tree's and (here, the
    same tree again as --compare-src) another's, from worker processes that import each tree;
    with --stop, every request carries a stop string."""
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_engine.py",
            "--null-model",
            "--threads",
            "1",
            "--batch",
            "8",
            "--new-tokens",
            "4",
            "--repeats",
            "1",
            "--stop",
            "@@",
            "--compare-src",
            ROOT,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    ours, theirs = (sum(line.startswith(tree) for line in lines) for tree in ("this tree: ", f"{ROOT}: "))
    assert ours == theirs == 4, proc.stdout
    assert "host time per decode step at batch 8:" in proc.stdout and "ratio " in proc.stdout
    assert "stop '@@'" in proc.stdout  # every request carried the stop string
