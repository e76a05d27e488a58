"""The demo script, run as the README runs it: it must learn (slow: about 6 minutes on 2 cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.e2e
def test_demo_raises_held_out_accuracy_by_25_points(tmp_path):
    out = tmp_path / "demo"
    env = {**os.environ, "PYTHON": sys.executable, "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "run-tiny-cpu.sh"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/accuracy" in r]
    assert evals[0]["step"] == 0  # evaluated before the first rollout
    gain = evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"]
    assert gain >= 0.25, [(r["step"], r["eval/accuracy"]) for r in evals]
    assert "held-out accuracy:" in proc.stdout
    png = (out / "logs" / "reward_accuracy.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert (out / "final" / "config.json").is_file()


@pytest.mark.slow
@pytest.mark.e2e
def test_the_demo_with_ppo_and_a_critic_learns(tmp_path):
    """`bash scripts/run-tiny-cpu.sh OUT --advantage-estimator ppo`, 150 rollouts (about 3 minutes):
    held-out accuracy up by 20 points or more (measured: +27.5, docs/ppo.md), the critic's metrics
    logged every step."""
    out = tmp_path / "ppo"
    env = {**os.environ, "PYTHON": sys.executable, "RAY_AUTH_MODE": "disabled", "NUM_ROLLOUT": "150"}
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "run-tiny-cpu.sh"), str(out), "--advantage-estimator", "ppo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "eval/accuracy" in r]
    assert evals[-1]["eval/accuracy"] - evals[0]["eval/accuracy"] >= 0.20, [r["eval/accuracy"] for r in evals]
    trained = [r for r in records if "rollout/reward_mean" in r]
    assert all("train/critic-value_loss" in r and "rollout/values" in r for r in trained)


def _demo(out, num_rollout: int, eval_interval: int, *flags: str) -> list[tuple[int, float]]:
    """The demo script's (step, held-out accuracy) after `num_rollout` rollouts with `flags`."""
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "RAY_AUTH_MODE": "disabled",
        "NUM_ROLLOUT": str(num_rollout),
        "EVAL_INTERVAL": str(eval_interval),
    }
    proc = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "run-tiny-cpu.sh"), str(out), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]


@pytest.mark.slow
@pytest.mark.e2e
def test_opd_from_the_demos_final_model_lifts_the_student_faster_than_grpo(tmp_path):
    """About 4.5 minutes. The teacher is the demo's final model after 150 rollouts (0.81 and 0.85
    held-out in two measurements); the student starts from the same SFT model (0.565). Over 60
    rollouts each, GRPO + OPD (--opd-type sglang: the job starts the teacher engine) is ahead of
    GRPO alone in mean held-out accuracy over steps 10..60: measured 0.711 vs 0.646 and 0.718 vs
    0.703 (docs/ppo.md). One run each and the runs are not bit-reproducible, so the bar is only
    "ahead"."""
    _demo(tmp_path / "teacher", 150, 50)
    opd = _demo(
        tmp_path / "opd",
        60,
        10,
        "--use-opd",
        "--opd-type",
        "sglang",
        "--opd-teacher-load",
        str(tmp_path / "teacher" / "final"),
    )
    grpo = _demo(tmp_path / "grpo", 60, 10)
    assert [s for s, _ in opd] == [s for s, _ in grpo] == list(range(0, 70, 10))

    def mean(curve):
        return sum(a for s, a in curve if s > 0) / (len(curve) - 1)

    assert mean(opd) > mean(grpo), (opd, grpo)
