"""Metrics sinks: metrics.jsonl, TensorBoard event files, wandb offline runs."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from slime.config.arguments import LoggingConfig
from slime.utils.tracking import Tracker, check_available


def test_jsonl_record_per_step(tmp_path):
    tracker = Tracker(str(tmp_path))
    tracker.log({"rollout_id": -1, "eval/accuracy": 0.25}, step=0)
    tracker.log({"rollout_id": 0, "rollout/reward_mean": 0.5, "note": "text is kept"}, step=1)
    tracker.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 0, "rollout_id": -1, "eval/accuracy": 0.25},
        {"step": 1, "rollout_id": 0, "rollout/reward_mean": 0.5, "note": "text is kept"},
    ]


def test_tensorboard_scalars_read_back(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(str(tmp_path), LoggingConfig(use_tensorboard=True))
    for step in range(3):
        tracker.log({"rollout/reward_mean": 0.1 * step, "time/step": 2.0}, step=step)
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    got = [(e.step, round(e.value, 6)) for e in events.Scalars("rollout/reward_mean")]
    assert got == [(0, 0.0), (1, 0.1), (2, 0.2)]


def test_wandb_offline_run_is_written_locally(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggingConfig(
        use_wandb=True,
        wandb_mode="offline",
        wandb_project="slime-test",
        wandb_group="g",
        wandb_team="team",
        wandb_dir=str(tmp_path / "runs"),
    )
    tracker = Tracker(str(tmp_path / "logs"), cfg, {"lr": 1e-3})
    tracker.log({"rollout/reward_mean": 0.5}, step=1)
    # as slime's: the group and name carry an 8-character random suffix unless --disable-wandb-random-suffix
    assert tracker._wandb.entity == "team" and tracker._wandb.group.startswith("g_")
    assert len(tracker._wandb.group) == 10 and tracker._wandb.name == tracker._wandb.group
    tracker.close()
    runs = [d for d in os.listdir(tmp_path / "runs" / "wandb") if d.startswith("offline-run-")]  # --wandb-dir
    assert len(runs) == 1
    files = os.listdir(tmp_path / "runs" / "wandb" / runs[0])
    assert any(f.endswith(".wandb") for f in files)
    plain = dataclasses.replace(cfg, wandb_random_suffix=False, wandb_run_id="myrun42")
    tracker = Tracker(str(tmp_path / "logs2"), plain)
    assert tracker._wandb.group == "g" and tracker._wandb.id == "myrun42"
    tracker.close()


def test_tensorboard_directory_follows_slimes_names(tmp_path, monkeypatch):
    from slime.utils.tracking import tensorboard_dir

    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    cfg = LoggingConfig(use_tensorboard=True)
    assert tensorboard_dir(cfg, "logs") == os.path.join("logs", "tensorboard")
    named = dataclasses.replace(cfg, tb_project_name="proj", tb_experiment_name="exp1")
    assert tensorboard_dir(named, "logs") == os.path.join("tensorboard_log", "proj", "exp1")
    assert tensorboard_dir(dataclasses.replace(named, tb_experiment_name=None), "logs").startswith(
        os.path.join("tensorboard_log", "proj", "20")
    )
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "env"))
    assert tensorboard_dir(named, "logs") == str(tmp_path / "env")
    assert tensorboard_dir(dataclasses.replace(named, tb_dir="given"), "logs") == "given"


def test_a_wandb_key_means_online_unless_a_mode_is_given(tmp_path, monkeypatch):
    from slime.ray.cli import parse_args

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = [
        "--hf-checkpoint",
        "/m",
        "--prompt-data",
        str(prompts),
        "--rollout-batch-size",
        "1",
        "--num-rollout",
        "1",
        "--rm-type",
        "exact",
        "--wandb-team",
        "t",
        "--wandb-host",
        "https://w.example",
    ]
    assert parse_args(base).logging.wandb_mode == "offline"
    cfg = parse_args([*base, "--wandb-key", "k"]).logging
    assert (cfg.wandb_mode, cfg.wandb_key, cfg.wandb_host, cfg.wandb_team) == (
        "online",
        "k",
        "https://w.example",
        "t",
    )
    assert parse_args([*base, "--wandb-key", "k", "--wandb-mode", "offline"]).logging.wandb_mode == "offline"


def test_missing_package_is_named(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
    assert "pip install wandb" in (check_available(True, False) or "")
    assert check_available(False, False) is None
