"""On-policy distillation jobs started as users start them (real Ray, torch engines, FSDP): the
job starts the teacher engine from --opd-teacher-load, the samples and dumps carry the teacher's
log-probs, a train-only replay needs no teacher, and a teacher with another tokenizer stops the
job before anything starts."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_loop_e2e import prompts, run_job  # noqa: F401 - prompts is a fixture
from tests.test_teacher import swapped_tokenizer

pytestmark = pytest.mark.e2e


def records(logs) -> list[dict]:
    return [json.loads(line) for line in (logs / "metrics.jsonl").read_text().splitlines()]


def train_metrics(logs) -> list[tuple]:
    return [
        (r["rollout_id"], r.get("train/pg_loss"), r.get("train/grad_norm"), r.get("rollout/opd_reverse_kl"))
        for r in records(logs)
        if r["rollout_id"] >= 0
    ]


@pytest.mark.slow  # ~40 s: a student and a teacher engine and a replay
def test_an_opd_job_scores_with_a_teacher_engine_and_replays_without_it(
    tiny_model,
    tiny_model_b,
    tmp_path,
    prompts,
):
    dumps = tmp_path / "dumps" / "rollout_{rollout_id}.pt"
    opd = ["--use-opd", "--opd-type", "sglang", "--opd-kl-coef", "0.5", "--rm-type", "exact"]
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        *opd,
        "--opd-teacher-load",
        tiny_model_b,
        "--save-debug-rollout-data",
        str(dumps),
        "--check-precision",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stderr + proc.stdout
    assert "OPD teacher engine: bundle(s) 2 (1 CPU each)" in out and f"({tiny_model_b})" in out
    for r in [r for r in records(tmp_path / "logs") if r["rollout_id"] >= 0]:
        # the student (tiny_model) and teacher (tiny_model_b) differ: a real reverse KL
        assert r["rollout/teacher_log_probs"] < 0 and r["rollout/opd_reverse_kl"] != 0
    for k in range(2):
        for s in torch.load(str(dumps).format(rollout_id=k), weights_only=True)["samples"]:
            assert len(s["teacher_log_probs"]) == s["response_length"]
            assert all(v <= 0 for v in s["teacher_log_probs"])
    # The replay: the teacher's log-probs come from the dumps; no engine, no teacher.
    replay = tmp_path / "replay"
    replay.mkdir()
    again = run_job(
        "train.py",
        tiny_model,
        prompts,
        replay,
        *opd,
        "--opd-teacher-load",
        tiny_model_b,
        "--load-debug-rollout-data",
        str(dumps),
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "OPD teacher engine" not in again.stderr + again.stdout
    assert train_metrics(replay / "logs") == train_metrics(tmp_path / "logs")


def test_a_teacher_with_another_tokenizer_stops_the_job_before_it_starts(tiny_model, prompts, tmp_path):
    other = swapped_tokenizer(tiny_model, tmp_path / "teacher")
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        "--use-opd",
        "--opd-type",
        "sglang",
        "--opd-teacher-load",
        other,
        "--rm-type",
        "exact",
    )
    assert proc.returncode == 2
    assert f"--opd-teacher-load '{other}': its tokenizer (101 tokens) is not --hf-checkpoint" in proc.stderr
