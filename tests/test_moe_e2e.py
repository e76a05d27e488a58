"""A mixture-of-experts job started as users start it (real Ray, torch engines, gloo ranks):
the engines report each token's experts, the trainer replays them (R3), and --check-precision's
step-0 gates (bitwise actor == reference, KL 0, trainer vs engine log-probs, the fingerprinted
weight push with per-expert tensor names) all pass."""

from __future__ import annotations

import json

import pytest

from tests.test_loop_e2e import prompts, run_job  # noqa: F401 - prompts is a fixture

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize(
    "backend",
    [
        # ~40 s: routing replay's parts are tested in process (tests/test_routing.py, the engine's
        # routed experts in tests/test_engine_moe.py, FSDP's replay in tests/test_fsdp_moe.py)
        pytest.param([], marks=pytest.mark.slow),
        # ~25 s: the Megatron actor at EP 2 with the weight checks; its parts are tested in process
        # (tests/test_megatron_moe_actor.py, the EP 2 push in tests/test_actor_push.py)
        pytest.param(
            [
                "--train-backend",
                "megatron",
                "--actor-num-gpus-per-node",
                "2",
                "--expert-model-parallel-size",
                "2",
                "--check-weight-sync",
                "--check-weight-update-equal",
            ],
            marks=pytest.mark.slow,
        ),
    ],
    ids=["fsdp", "megatron-ep2"],
)
def test_rollout_routing_replay_job_passes_the_step_0_gates(tiny_moe, prompts, tmp_path, backend):
    proc = run_job(
        "train.py",
        tiny_moe,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--check-precision",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.01",
        "--use-rollout-routing-replay",
        "--save-debug-rollout-data",
        str(tmp_path / "rollout_{rollout_id}.pt"),
        *backend,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    checks = json.loads((tmp_path / "logs" / "precision.json").read_text())["checks"]
    assert checks and all(c["ok"] is not False for c in checks), checks
    import torch

    dump = torch.load(tmp_path / "rollout_0.pt", weights_only=False)
    for sample in dump["samples"]:
        routed = torch.as_tensor(sample["rollout_routed_experts"])
        assert routed.shape == (len(sample["tokens"]) - 1, 2, 2)
        assert int(routed.min()) >= 0 and int(routed.max()) < 4
