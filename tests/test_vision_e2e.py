"""Vision-language RL started as users start it: train.py with --multimodal-keys on the tiny
Qwen3-VL (real Ray, a real torch engine, a gloo train rank), then a train-only replay of its
dump with --check-precision, and bad image data stopped before anything starts."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.test_loop_e2e import run_job

pytestmark = pytest.mark.e2e

KEYS = ["--multimodal-keys", '{"image": "images"}', "--apply-chat-template", "--input-key", "prompt"]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from slime.tools.make_vision_task import main

    out = str(tmp_path_factory.mktemp("vision") / "task")
    assert main(["--out", out, "--train-size", "8", "--eval-size", "4", "--sft-size", "0"]) == 0
    return out


@pytest.fixture(scope="module")
def job(tiny_vlm, task, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vlm-job")
    template = str(tmp / "dumps" / "rollout_{rollout_id}.pt")
    proc = run_job(
        "train.py",
        tiny_vlm,
        f"{task}/train.jsonl",
        tmp,
        *KEYS,
        "--rm-type",
        "exact",
        "--rollout-max-response-len",
        "2",
        "--save-debug-rollout-data",
        template,
        "--check-precision",
        "--eval-interval",
        "2",
        "--eval-prompt-data",
        f"{task}/eval.jsonl",
    )
    return tmp, template, proc


def test_a_vision_language_job_trains_with_engine_and_trainer_agreeing(job):
    tmp, template, proc = job
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--check-precision: passed at rollout 0" in proc.stderr
    records = [json.loads(line) for line in (tmp / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] >= 1]
    assert len(steps) == 2 and "eval/accuracy" in records[0] and "eval/accuracy" in steps[-1]
    # on-policy (train.py): the trainer's log-probs of rollout 0 are the engine's, images included
    assert steps[0]["rollout/train_rollout_logprob_abs_diff_max"] < 1e-5
    dump = torch.load(template.format(rollout_id=0), weights_only=True)
    sample = dump["samples"][0]
    assert sample["multimodal_inputs"]["images"][0].shape == (64, 64, 3)
    assert sample["multimodal_train_inputs"]["image_grid_thw"].tolist() == [[1, 4, 4]]


@pytest.mark.slow  # about 15 s; the replay's layers (dumps with images, their batch) are tested in process
def test_train_only_replays_the_multimodal_dump(job, tiny_vlm, task, tmp_path):
    _, template, proc = job
    assert proc.returncode == 0, proc.stderr[-3000:]
    replay = run_job(
        "train.py",
        tiny_vlm,
        f"{task}/train.jsonl",
        tmp_path,
        *KEYS,
        "--load-debug-rollout-data",
        template,
        "--check-precision",
        "--num-rollout",
        "1",
    )
    assert replay.returncode == 0, replay.stderr[-3000:]
    assert "mode: train only (no engine)" in replay.stderr
    assert "--check-precision: passed at rollout 0" in replay.stderr
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["rollout/train_rollout_logprob_abs_diff_max"] < 1e-5


def test_a_missing_image_exits_2_naming_the_row_and_file(tiny_vlm, task, tmp_path):
    rows = [json.loads(line) for line in open(f"{task}/train.jsonl")]
    rows[3]["images"] = [os.path.join(task, "images", "gone.png")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = run_job("train.py", tiny_vlm, str(bad), tmp_path, *KEYS, "--rm-type", "exact")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "bad.jsonl:4: field 'images'[0]: image file" in proc.stderr and "gone.png" in proc.stderr
    assert "TrainRank" not in proc.stderr  # nothing started
