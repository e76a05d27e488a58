"""A LoRA job started as users start it (real Ray, a colocated torch engine, the FSDP actor with
PEFT adapters): the step-0 gates, the merged push checked against the engine, adapter-only
checkpoints that resume, and a PEFT adapter directory from --save-hf."""

from __future__ import annotations

import json
import os

import pytest

from tests.test_loop_e2e import prompts, run_job  # noqa: F401 - prompts is a fixture

pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[lora]')")
pytestmark = pytest.mark.e2e

LORA = ["--rm-type", "exact", "--lora-rank", "8", "--lora-alpha", "16", "--target-modules", "all-linear"]


@pytest.mark.slow  # ~53 s; the adapter-push job below keeps a LoRA job in the default run
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_a_lora_job_pushes_merged_weights_saves_adapters_and_resumes(tiny_model, prompts, tmp_path, backend):
    save = str(tmp_path / "ckpt")
    common = [*LORA, "--colocate", "--save", save, "--use-kl-loss", "--kl-loss-coef", "0.01"]
    common += ["--train-backend", backend]
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        *common,
        "--check-precision",
        "--check-weight-update-equal",
        "--save-hf",
        str(tmp_path / "hf"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stderr + proc.stdout
    assert "--check-precision: passed at rollout 0: ppo_kl 0, actor == reference bitwise, kl_loss 0" in out
    assert "after the first push every engine parameter equals the checkpoint" in out
    assert sorted(os.listdir(tmp_path / "hf")) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((tmp_path / "hf" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 16)
    again = run_job("train.py", tiny_model, prompts, tmp_path, *common, "--load", save, "--num-rollout", "3")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed after rollout 1" in again.stderr + again.stdout
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["rollout_id"] == 2 and records[-1]["train/grad_norm"] > 0


@pytest.mark.parametrize("backend", ["fsdp", pytest.param("megatron", marks=pytest.mark.slow)])
def test_a_lora_job_can_push_the_adapter_alone(tiny_model, prompts, tmp_path, backend):
    """--lora-push adapter: the engines start with --enable-lora, get the adapter before the first
    rollout, every push sends the adapter alone (a few hundred KB, not the model), and every
    request names it: the trainer's and the engine's log-probs of the samples agree after the
    adapters have trained (without the adapter the engine would sample from the base model).
    Colocated, the engines keep their base weights while the trainer runs."""
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        *LORA,
        "--train-backend",
        backend,
        "--colocate",
        "--lora-push",
        "adapter",
        "--num-rollout",
        "3",
        "--lr",
        "1e-2",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.01",
        "--check-weight-update-equal",
        "--check-weight-sync",
        "--save-debug-rollout-data",
        str(tmp_path / "r_{rollout_id}.pt"),
        "--save-debug-train-data",
        str(tmp_path / "t_{rollout_id}_{rank}.pt"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stderr + proc.stdout
    # The dumps record the adapter; its version is the samples' weight version (each push sets it).
    import torch

    rollout, train = torch.load(tmp_path / "r_2.pt"), torch.load(tmp_path / "t_2_0.pt")
    assert (
        rollout["meta"]["lora"]
        == train["lora"]
        == {
            "rank": 8,
            "alpha": 16,
            "target_modules": ["all-linear"],
            "target_parameters": [],
            "push": "adapter",
            "adapter": "slime_lora",
            "adapter_path": None,
        }
    )
    assert {v for s in rollout["samples"] for v in s["weight_versions"]} == {"2"}
    # --check-weight-update-equal on the adapter push: the base weights untouched, the adapter
    # checked by the engine against the trainer's sha256 (every push, with --check-weight-sync).
    assert "every engine received the trainer's adapter bit for bit (sha256)" in out
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    assert last["rollout_id"] == 2
    # The adapters moved the policy away from the base model (kl_loss), and the engine's
    # log-probs are still the trainer's: it sampled with the adapter.
    assert abs(last["train/kl_loss"]) > 1e-6, last
    assert last["rollout/train_rollout_logprob_abs_diff"] < 1e-5, last
    pushes = [line for line in out.splitlines() if "pushed the LoRA adapter 'slime_lora'" in line]
    assert len(pushes) == 4  # before the first rollout, then after each of the three steps
    assert all(" MB in 56 tensors" in line and "56 sha256 checked by every engine" in line for line in pushes)


@pytest.mark.slow
def test_the_sync_dumps_compare_the_engines_adapter_with_the_trainers(tiny_model, prompts, tmp_path):
    """--debug-sync-parameters-path with --lora-push adapter: the engine dumps its base weights
    before and after the push and its adapter after; the trainer writes the adapter it pushed
    beside the engine's `before` dump; check_sync_parameter passes on every tensor."""
    import subprocess
    import sys

    root = tmp_path / "sync"
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        *LORA,
        "--lora-push",
        "adapter",
        "--debug-sync-parameters-path",
        str(root),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    check = subprocess.run(
        [sys.executable, "-m", "slime.tools.check_sync_parameter", "--root_dir", str(root)],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout[-3000:]
    passed = [line for line in check.stdout.splitlines() if line.startswith("PASS|0|slime_lora.layers.")]
    assert len(passed) == 56 and "PASS|0|slime_lora.layers.0.self_attn.q_proj.lora_B.weight" in passed
    assert "PASS|0|model.layers.0.self_attn.q_proj.weight" in check.stdout
