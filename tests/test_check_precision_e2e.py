"""--check-precision on setups broken on purpose, started as users start them (real Ray,
engines and gloo ranks): each fails before or at the first rollout with its report, exit code 1."""

from __future__ import annotations

import json

import pytest

from tests.test_loop_e2e import prompts, run_job  # noqa: F401 - prompts is a fixture

pytestmark = pytest.mark.e2e


def gates(tmp_path):
    return {g["name"]: g for g in json.loads((tmp_path / "logs" / "precision.json").read_text())["checks"]}


def test_a_wrong_weight_push_is_stopped_at_the_step_0_push(tiny_model, prompts, tmp_path):
    """--check-precision pushes before the first rollout and fingerprints the push
    (--check-weight-sync): a wrong tensor stops the job there, naming it."""
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--check-precision",
        "--debug-push-fault",
        "noise:model.layers.0.mlp.down_proj.weight",
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "every weight push is broken on purpose" in proc.stderr
    assert "--check-weight-sync: after the weight push of version 0" in proc.stderr
    assert "differs: model.layers.0.mlp.down_proj.weight" in proc.stderr
    assert "rollout 1/2" not in proc.stderr and "weight_version 1 via" not in proc.stderr


# ~22 s; the step-0 gates fail a job in test_a_wrong_weight_push_is_stopped_at_the_step_0_push too
@pytest.mark.slow
def test_a_reference_unlike_the_actor_fails_bitwise_and_kl(tiny_model, tiny_model_b, prompts, tmp_path):
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--check-precision",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.01",
        "--ref-load",
        tiny_model_b,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "2 of 6 checks FAILED at rollout 0" in proc.stderr
    assert f"--ref-load {tiny_model_b} is another checkpoint than --hf-checkpoint" in proc.stderr
    result = gates(tmp_path)
    assert [n for n, g in result.items() if g["ok"] is False] == [
        "actor log-probs == reference log-probs (bitwise)",
        "kl_loss == 0 on the first optimizer step",
    ]
    assert result["trainer vs engine log-probs (mean and max |diff|)"]["ok"]  # the engines are fine
