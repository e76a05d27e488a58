"""train.py / train_async.py started the way users start them (a subprocess, real Ray, real engines)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text(
        "".join(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(10))
    )
    return str(path)


def run_job(script, model, prompts, tmp_path, *extra, env=None, path=()):
    """Run `script` as users do; `env` adds variables, `path` folders in front of PYTHONPATH.

    The job attaches to the session's shared Ray cluster (RAY_ADDRESS), or to the one `env`
    names. Its actors start with the cluster's environment, not the driver's: `env` and the
    PYTHONPATH reach them as `ray job submit --runtime-env-json '{"env_vars": ...}'` sends them,
    in the job config Ray reads from RAY_JOB_CONFIG_JSON_ENV_VAR."""
    from tests.ray_cluster import shared_address

    own = {k: v for k, v in (env or {}).items() if k != "RAY_ADDRESS"}
    # The caller's PYTHONPATH stays behind ours (the offline GPU machine finds Ray and
    # megatron-core there).
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    pythonpath = os.pathsep.join([*path, ROOT, str(tmp_path), *inherited])
    runtime_env = {"env_vars": {**own, "PYTHONPATH": pythonpath, "OMP_NUM_THREADS": "1"}}
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "disabled",
        "OMP_NUM_THREADS": "1",
        "SLIME_LOG_DIR": str(tmp_path / "logs"),
        "PYTHONPATH": pythonpath,
        **own,
        "RAY_ADDRESS": (env or {}).get("RAY_ADDRESS") or shared_address(),
        "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": runtime_env}),
    }
    argv = [
        sys.executable,
        os.path.join(ROOT, script),
        "--hf-checkpoint",
        model,
        "--prompt-data",
        prompts,
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        *(["--num-rollout", "2"] if "--num-rollout" not in extra else []),
        "--rollout-max-response-len",
        "3",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "4",
        *extra,
    ]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=str(tmp_path))


@pytest.mark.parametrize(
    "script, layout",
    [
        ("train.py", ["--colocate", "--update-weight-transport", "distributed"]),
        # ~35 s; train_async.py runs end to end in tests/test_continuous_e2e.py, the tensor push
        # with two ranks in tests/test_actor_push.py
        pytest.param(
            "train_async.py",
            ["--rollout-num-gpus", "2", "--update-weight-transport", "tensor"],
            marks=pytest.mark.slow,
        ),
    ],
)
def test_two_ranks_run_and_save(tiny_model, prompts, tmp_path, script, layout):
    # One unnamed evaluation set (metrics eval/...), or two named ones (eval/<name>...).
    named = script == "train_async.py"
    sets = ["held", prompts, "again", prompts] if named else [prompts]
    proc = run_job(
        script,
        tiny_model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--actor-num-gpus-per-node",
        "2",
        *layout,
        "--save",
        str(tmp_path / "ckpt"),
        "--eval-interval",
        "2",
        "--eval-prompt-data",
        *sets,
        "--eval-temperature",
        "0",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.01",
        "--use-tensorboard",
        "--check-precision",
        "--check-weight-update-equal",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The step-0 gates pass on a correct setup, across ranks, transports and schedules.
    # Snapshot, noise, push, compare: the first push restored every engine parameter exactly; then
    # every push is fingerprinted (--check-precision turns --check-weight-sync on).
    assert "after the first push every engine parameter equals the checkpoint" in proc.stderr
    assert len(set(re.findall(r"46 tensors match on every engine, weight version (\d+)", proc.stderr))) == 3
    assert (
        "--check-precision: passed at rollout 0: ppo_kl 0, actor == reference bitwise, kl_loss 0"
        in proc.stderr
    )
    gates = json.loads((tmp_path / "logs" / "precision.json").read_text())["checks"]
    assert len(gates) == 6 and all(g["ok"] for g in gates)
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["rollout_id"], r["step"]) for r in records] == [(-1, 0), (0, 1), (1, 2)]
    keys = ["eval/held", "eval/held/accuracy", "eval/again-truncated_ratio"] if named else ["eval/accuracy"]
    for key in keys:
        assert key in records[0] and key in records[2] and key not in records[1], key
    if named:  # greedy on the same prompts with the same weights: the two sets agree
        assert records[0]["eval/held"] == records[0]["eval/again"] and "eval/accuracy" not in records[0]
    assert (
        "device: cpu (auto: no GPU is visible)" in proc.stderr and "train backend: fsdp (auto" in proc.stderr
    )
    steps = records[1:]
    assert all("rollout/reward_mean" in r and "train/grad_norm" in r and r["push/bytes"] > 0 for r in steps)
    for r in steps:
        for key in (
            "rollout/log_probs",
            "rollout/ref_log_probs",
            "rollout/rollout_log_probs",
            "rollout/kl",
            "rollout/train_rollout_logprob_abs_diff",
            "rollout/response_length_mean",
            "rollout/truncated_ratio",
            "train/entropy",
            "train/pg_clipfrac",
            "train/kl_loss",
            "time/generate",
            "time/reward",
            "time/log_probs",
            "time/train",
            "time/push",
            "time/idle",
            "perf/actor_train_tok_per_s",
            "perf/actor_train_tflops",
            "perf/log_probs_tflops",
            "perf/ref_log_probs_tflops",
        ):
            assert key in r, key
        assert "perf/actor_train_mfu" not in r  # no peak known for a CPU
        assert r["rollout/log_probs"] < 0
        assert 0 <= r["time/idle_ratio"] < 1 and r["time/step"] >= r["time/train"] + r["time/push"]
    assert steps[0]["rollout/kl"] == 0.0  # the first rollout: actor == reference
    assert os.listdir(tmp_path / "logs" / "tensorboard")
    assert "2 × fsdp rank (CPU process each)" in proc.stderr
    assert "[rank 0] INFO" in proc.stderr and "[rank 1] INFO" in proc.stderr  # per-rank log prefixes
    assert ("colocated" if "--colocate" in layout else "disaggregated") in proc.stderr
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "1"


def test_bad_flags_exit_2_before_starting_anything(tiny_model, prompts, tmp_path):
    proc = run_job(
        "train.py", tiny_model, prompts, tmp_path, "--rm-type", "exact", "--global-batch-size", "3"
    )
    assert proc.returncode == 2 and "--global-batch-size 3" in proc.stderr and "Traceback" not in proc.stderr


# ~60 s; resume is tested in process (test_loop_core, the actors' checkpoint tests) and by test_chaos
@pytest.mark.slow
def test_resume_after_a_crash_continues_from_the_saved_rollout(tiny_model, prompts, tmp_path):
    # The reward function crashes once it has scored 3 rollouts' worth of samples (8 each).
    (tmp_path / "flaky_rm.py").write_text(
        "import os\n"
        "calls = 0\n"
        "def reward(args, sample):\n"
        "    global calls\n"
        "    calls += 1\n"
        "    if os.environ.get('CRASH') and calls > 24:\n"
        "        raise RuntimeError('simulated crash')\n"
        "    return float(sample.response.strip() == sample.label)\n"
    )
    ckpt = str(tmp_path / "ckpt")
    common = [
        "--custom-rm-path",
        "flaky_rm.reward",
        "--num-rollout",
        "5",
        "--save",
        ckpt,
        "--save-interval",
        "1",
        "--load",
        ckpt,
        "--rollout-shuffle",
    ]
    crashed = run_job("train.py", tiny_model, prompts, tmp_path, *common, env={"CRASH": "1"})
    # A failing reward function ends the job with exit code 1, naming its error.
    assert crashed.returncode == 1 and "job failed: RuntimeError: simulated crash" in crashed.stderr
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "2"
    resumed = run_job("train.py", tiny_model, prompts, tmp_path, *common)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed after rollout 2 (data position {'epoch': 1, 'offset': 2})" in resumed.stderr, (
        resumed.stderr[-2500:]
    )
    ids = [
        json.loads(line)["rollout_id"]
        for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    assert ids == [0, 1, 2, 3, 4]
