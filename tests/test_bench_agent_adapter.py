"""benchmarks/bench_agent_adapter.py keeps running: its smallest arguments, end to end."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_agent_adapter_runs_and_prints_its_table(tiny_model):
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/bench_agent_adapter.py",
            "--sessions",
            "1",
            "--turns",
            "2",
            "--max-new-tokens",
            "2",
            "--model-path",
            tiny_model,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| through the adapter |" in proc.stdout and "added per turn: p50" in proc.stdout
    assert "samples that forked or realigned: 0 of 1" in proc.stdout
