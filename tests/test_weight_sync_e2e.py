"""The parameter-sync checks in real jobs (Ray, engines, gloo ranks), started as users start them."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.test_loop_e2e import ROOT, prompts, run_job  # noqa: F401 - prompts is a fixture

Q0, Q1 = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.q_proj.weight"

pytestmark = pytest.mark.e2e


@pytest.mark.slow  # ~27 s; the online check below stops a job at a broken push too
def test_dump_mode_then_the_checker_find_a_wrong_mapping(tiny_model, prompts, tmp_path, monkeypatch):
    root = tmp_path / "sync"
    monkeypatch.setenv("DEBUG_SYNC_PARAMETERS_PATH", str(root))
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--debug-push-fault",
        f"swap:{Q0},{Q1}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"python -m slime.tools.check_sync_parameter --root_dir {root}" in proc.stderr
    assert "rollout 1/2" not in proc.stderr  # it exits after the first push
    for part in ("before_sync_parameter", "after_sync_parameter"):
        assert len(list((root / part / "0").iterdir())) == 46
    check = subprocess.run(
        [sys.executable, "-m", "slime.tools.check_sync_parameter", "--root_dir", str(root)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert check.returncode == 1
    lines = check.stdout.splitlines()
    assert sorted(line.split("|")[2] for line in lines if line.startswith("DIFF|")) == [Q0, Q1]
    assert lines[-1] == "ALL: 46, PASS: 44, DIFF: 2, MISSING: 0"
    # The dumps are never overwritten: a second run into the same directory is refused.
    again = run_job("train.py", tiny_model, prompts, tmp_path, "--rm-type", "exact")
    assert again.returncode == 2 and "already holds before_sync_parameter/" in again.stderr


def test_online_check_stops_the_job_at_a_dropped_tensor(tiny_model, prompts, tmp_path):
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--check-weight-sync",
        "--debug-push-fault",
        "drop:model.norm.weight",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "--check-weight-sync: after the weight push of version 1" in proc.stderr
    assert "not pushed: model.norm.weight (the engine holds it, the push never wrote it)" in proc.stderr
    assert "rollout 2/2" not in proc.stderr


@pytest.mark.slow  # ~30 s; the delta transport and /pull_weights are tested in process in test_delta_sync.py
def test_a_delta_sync_job_keeps_the_engines_equal_to_the_trainer(tiny_model, prompts, tmp_path):
    shared, local = tmp_path / "shared", tmp_path / "host"
    proc = run_job(
        "train_async.py",
        tiny_model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--check-weight-sync",
        "--update-weight-transport",
        "disk",
        "--update-weight-mode",
        "delta",
        "--update-weight-disk-dir",
        str(shared),
        "--update-weight-local-checkpoint-dir",
        str(local),
        "--keep-old-actor",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "via disk_delta" in proc.stderr and "rollout 2/2" in proc.stderr
    assert sorted(p.name for p in shared.iterdir()) == ["weight_v000001", "weight_v000002"]
    assert (local / "slime_weight_version.json").exists()
