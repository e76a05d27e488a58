"""scripts/gpu-check.sh where no GPU is visible: every part is listed as SKIP, none as PASS, exit 0.

CUDA_VISIBLE_DEVICES is emptied, so this holds on a GPU machine too; nothing is run beyond the
script's own dependency checks (a few seconds).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ["gpu-tests", "grpo-fsdp", "grpo-megatron", "bench-engine", "bench-step"]
NO_GPU = "no CUDA GPU (torch.cuda.is_available() is false)"


def run_script(tmp_path, *parts):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "GPU_CHECK_OUT": str(tmp_path / "out"),
        "CUDA_VISIBLE_DEVICES": "",
    }
    env.pop("GPU_CHECK_DEVICE", None)  # the CPU rehearsal switch would run the jobs
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh"), *parts],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )


def part_lines(stdout: str) -> list[str]:
    """The per-part lines printed as the parts run (the summary repeats them, indented)."""
    return [line for line in stdout.splitlines() if line.split(" ", 1)[0] in ("PASS", "FAIL", "SKIP")]


def test_without_a_gpu_every_part_is_skipped_and_the_exit_code_is_0(tmp_path):
    proc = run_script(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = part_lines(proc.stdout)
    assert [line.split()[1] for line in lines] == PARTS, proc.stdout
    for line in lines:
        assert line.startswith("SKIP ") and line.endswith(NO_GPU), line
    assert "PASS" not in proc.stdout and "FAIL" not in proc.stdout
    assert f"logs in {tmp_path / 'out'}" in proc.stdout
    assert "summary: 0 passed, 0 failed, 5 skipped" in proc.stdout


def test_the_caller_chooses_the_parts_and_an_unknown_part_exits_2(tmp_path):
    proc = run_script(tmp_path, "bench-engine", "gpu-tests")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [line.split()[1] for line in part_lines(proc.stdout)] == ["bench-engine", "gpu-tests"]
    bad = run_script(tmp_path, "grpo")
    assert bad.returncode == 2 and "unknown part 'grpo'" in bad.stderr
