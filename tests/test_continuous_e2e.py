"""train_async.py with the continuous schedule, started as users start it (real Ray, a torch engine)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_job_timeline import check_job_trace
from tests.test_loop_e2e import prompts, run_job  # noqa: F401  (the module's prompt file fixture)

pytestmark = pytest.mark.e2e


async def last_token_parity(args, sample):
    """A reward that varies within a group (the tiny model's answers are never right), so every
    step has a gradient for the replay to reproduce."""
    return float(sample.tokens[-1] % 2)


def check_continuous_timeline(trace_dir, log):
    """--trace-dir of a fully async job: every process's track, the rollout manager taking each
    rollout from the pool while the engine generates across the steps, the table in the log."""
    tracks = check_job_trace(trace_dir, {"driver", "rollout manager", "engine 0", "train rank 0"})
    driver = [e["name"] for e in tracks["driver"] if e.get("cat") == "step"]
    assert driver == [f"rollout {k}" for k in range(4)]
    manager = tracks["rollout manager"]
    assert [e["args"]["rollout_id"] for e in manager if e["name"] == "take"] == [0, 1, 2, 3]
    assert any(e["name"] == "reward_model" for e in manager)
    engine = {e["name"] for e in tracks["engine 0"]}
    assert {"busy", "requests", "update_weights_from_tensor", "pause_generation"} <= engine
    rank = [e["name"] for e in tracks["train rank 0"]]
    assert rank.count("log_probs") == 4 and rank.count("save") == 2 and "bucket 0" in rank
    assert "where the time went" in log and "generation and training overlapped" in log


def _train_metrics(log_dir):
    records = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["rollout_id"], r["train/loss"], r["train/pg_loss"], r["train/grad_norm"]) for r in records]


def test_fully_async_job_keeps_every_trained_token_within_the_lag_bound(tiny_model, prompts, tmp_path):
    """A continuous run: the lag bound holds for every trained token (metrics and dumps), a
    checkpoint returns the prompts in flight, and its dumps replayed (train.py
    --load-debug-rollout-data) train the same steps bit for bit: the dumps record what was trained."""
    dumps = tmp_path / "dumps" / "rollout_{rollout_id}.pt"
    proc = run_job(
        "train_async.py",
        tiny_model,
        prompts,
        tmp_path,
        "--custom-rm-path",
        "tests.test_continuous_e2e.last_token_parity",
        "--num-rollout",
        "4",
        "--rollout-function-path",
        "slime.rollout.fully_async_rollout.generate_rollout_fully_async",
        "--max-policy-version-lag",
        "1",
        "--rollout-max-response-len",
        "8",
        "--save-debug-rollout-data",
        str(dumps),
        "--save",
        str(tmp_path / "ckpt"),
        "--save-interval",
        "2",
        "--trace-dir",
        str(tmp_path / "trace"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "schedule: continuous" in proc.stderr
    check_continuous_timeline(tmp_path / "trace", proc.stderr)
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["rollout_id"] >= 0]
    assert len(steps) == 4
    for r in steps:
        assert r["rollout/policy_lag_max"] <= 1 and "rollout/in_flight_groups" in r
        assert 0 <= r["time/engine_busy_share"] <= 1
    # The property again from the dumps: every trained token's weights are at most 1 version behind
    # the trainer (which trains rollout k at version k: the first push is version 0).
    for k in range(4):
        dump = torch.load(str(dumps).format(rollout_id=k), weights_only=True)
        for s in dump["samples"]:
            versions = [int(v) for v, n in s["weight_version_spans"] for _ in range(n)]
            assert len(versions) == s["response_length"]
            assert all(k - v <= 1 for v, m in zip(versions, s["loss_mask"]) if m), (
                k,
                s["weight_version_spans"],
            )
            assert s["metadata"]["admitted_weight_version"] <= k
    # A checkpoint records the prompts drawn and not trained on (in flight, or finished and waiting):
    # with the ones trained, they are exactly the prompts drawn (10 per epoch, 4 per rollout).
    state = torch.load(tmp_path / "ckpt" / "iter_0000001" / "trainer_state.pt", weights_only=False)
    data = state["extra"]["data"]
    assert data["epoch"] * 10 + data["offset"] == 2 * 4 + len(data.get("returned", []))
    # The replay: the same steps from the dumps alone, no engine.
    replay = tmp_path / "replay"
    replay.mkdir()
    again = run_job(
        "train.py", tiny_model, prompts, replay, "--load-debug-rollout-data", str(dumps), "--num-rollout", "4"
    )
    assert again.returncode == 0, again.stderr[-3000:]
    original = _train_metrics(tmp_path / "logs")
    assert any(g > 0 for *_, g in original)
    assert _train_metrics(replay / "logs") == original  # bit for bit
