"""benchmarks/bench_families.py keeps running: its smallest arguments, end to end."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_families_runs_and_prints_its_table():
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_families.py",
            "--archs",
            "qwen3,qwen3_next",
            "--requests",
            "1",
            "--new-tokens",
            "2",
            "--hidden-size",
            "32",
            "--num-layers",
            "2",
            "--threads",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| qwen3")]
    assert [r.split(" | ")[:2] for r in rows] == [
        ["| qwen3", "BatchedRunner"],
        ["| qwen3_next", "BatchedRunner"],
    ]
    assert all(r.endswith("| yes |") for r in rows)  # tokens equal Hugging Face's
