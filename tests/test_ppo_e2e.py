"""A PPO job started as users start it (real Ray, torch engines, FSDP actor and critic ranks):
the critic-only warm-up, the critic's metrics beside the actor's, its checkpoints under
<--save>/critic, and a resumed run that picks both up."""

from __future__ import annotations

import json

import pytest

from tests.test_loop_e2e import prompts, run_job  # noqa: F401 - prompts is a fixture

pytestmark = pytest.mark.e2e

PPO = ["--rm-type", "exact", "--advantage-estimator", "ppo", "--num-critic-only-steps", "1"]


def records(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]


# ~45 s; the job below (slow too) also runs PPO end to end, tests/test_actor_critic_group.py the step
@pytest.mark.slow
def test_a_ppo_job_trains_the_critic_first_then_both(tiny_model, prompts, tmp_path):
    """Colocated: the critic rank shares the train rank's bundle with the engine. Its rollout
    dumps replay (--debug-train-only) with PPO and pass --check-precision, the critic's gate too."""
    dumps = str(tmp_path / "dumps" / "rollout_{rollout_id}.pt")
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        *PPO,
        "--save",
        str(tmp_path / "ckpt"),
        "--colocate",
        "--save-debug-rollout-data",
        dumps,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    first, second = records(tmp_path)[-2:]
    assert "train/critic-value_loss" in first and "train/pg_loss" not in first  # the critic only
    assert "train/critic-value_loss" in second and "train/pg_loss" in second
    assert {"rollout/values", "rollout/returns"} <= first.keys()
    assert (tmp_path / "ckpt" / "critic" / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert "critic rank 0: bundle 0 (0.2 CPU)" in proc.stderr + proc.stdout
    replay = tmp_path / "replay"
    replay.mkdir()
    again = run_job(
        "train.py",
        tiny_model,
        prompts,
        replay,
        *PPO,
        "--load-debug-rollout-data",
        dumps,
        "--debug-train-only",
        "--check-precision",
    )
    assert again.returncode == 0, again.stderr[-3000:]
    out = again.stderr + again.stdout
    assert "--check-precision: passed at rollout 0" in out and "critic values 0" in out


@pytest.mark.slow  # ~50 s: two runs of two ranks each
def test_a_ppo_job_on_two_ranks_resumes_actor_and_critic(tiny_model, prompts, tmp_path):
    save = str(tmp_path / "ckpt")
    common = [*PPO, "--save", save, "--actor-num-gpus-per-node", "2"]
    proc = run_job("train.py", tiny_model, prompts, tmp_path, *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "critic rank 1: bundle 4 (1 CPU)" in proc.stderr + proc.stdout  # apart: after the engines
    again = run_job("train.py", tiny_model, prompts, tmp_path, *common, "--load", save, "--num-rollout", "3")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed after rollout 1" in again.stderr + again.stdout
    last = records(tmp_path)[-1]
    assert last["rollout_id"] == 2 and "train/critic-value_loss" in last and "train/pg_loss" in last


# ~60 s: two runs of TP 2 actor and critic; tests/test_megatron_critic.py tests the critic in process
@pytest.mark.slow
def test_a_ppo_job_with_the_megatron_backend_resumes_actor_and_critic(tiny_model, prompts, tmp_path):
    """--train-backend megatron at TP 2, colocated: the Megatron critic beside the Megatron actor,
    --check-precision's gates (the critic's too), and a resumed run that picks both up."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")
    save = str(tmp_path / "ckpt")
    common = [
        *PPO,
        "--save",
        save,
        "--train-backend",
        "megatron",
        "--actor-num-gpus-per-node",
        "2",
        "--tensor-model-parallel-size",
        "2",
        "--colocate",
        "--check-precision",
    ]
    proc = run_job("train.py", tiny_model, prompts, tmp_path, *common)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stderr + proc.stdout
    assert "--check-precision: passed at rollout 0" in out and "critic values 0" in out
    first, second = records(tmp_path)[-2:]
    assert "train/critic-value_loss" in first and "train/pg_loss" not in first
    assert "train/critic-value_loss" in second and "train/pg_loss" in second
    critic_files = sorted(p.name for p in (tmp_path / "ckpt" / "critic" / "iter_0000001").iterdir())
    assert critic_files == ["mp_rank_00", "mp_rank_01"]
    again = run_job("train.py", tiny_model, prompts, tmp_path, *common, "--load", save, "--num-rollout", "3")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed after rollout 1" in again.stderr + again.stdout
    last = records(tmp_path)[-1]
    assert last["rollout_id"] == 2 and "train/critic-value_loss" in last and "train/pg_loss" in last
