"""The driver's choice of Ray cluster, without starting one (ray.init is recorded)."""

from __future__ import annotations

import pytest

from slime.ray import driver
from slime.ray.cli import parse_args


@pytest.fixture
def calls(monkeypatch):
    recorded: list[dict] = []
    monkeypatch.setattr(driver.ray, "init", lambda **kwargs: recorded.append(kwargs))
    return recorded


def _config(tiny_model, tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1=", "label": "2"}\n')
    return parse_args(
        [
            "--hf-checkpoint",
            tiny_model,
            "--prompt-data",
            str(tmp_path / "p.jsonl"),
            "--rollout-batch-size",
            "6",
            "--global-batch-size",
            "6",
            "--actor-num-gpus-per-node",
            "3",
            "--num-rollout",
            "1",
            "--rm-type",
            "exact",
        ]
    )


@pytest.mark.parametrize("value", [None, ""])
def test_without_ray_address_the_job_starts_a_ray_of_its_own(calls, monkeypatch, tiny_model, tmp_path, value):
    # Not ray.init()'s default, which attaches to a cluster `ray start` left on the machine (and
    # then refuses the CPU count a new Ray is sized with).
    if value is None:
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    else:
        monkeypatch.setenv("RAY_ADDRESS", value)
    driver.start_ray(_config(tiny_model, tmp_path))
    assert calls[0]["address"] == "local"
    assert calls[0]["num_cpus"] >= 4  # 3 train ranks + 1 engine, one bundle each, on any machine


@pytest.mark.parametrize("value", ["auto", "127.0.0.3:6379"])
def test_ray_address_attaches_without_sizing_the_cluster(calls, monkeypatch, tiny_model, tmp_path, value):
    monkeypatch.setenv("RAY_ADDRESS", value)
    driver.start_ray(_config(tiny_model, tmp_path))
    assert calls[0]["address"] == value and "num_cpus" not in calls[0]
