"""Each model family of docs/models.md in a GRPO job started as users start it (real Ray, a torch
engine, gloo ranks), with the FSDP backend and, for the families it builds, the Megatron backend:
--check-precision's step-0 gates (actor == reference bitwise, KL 0, trainer vs engine log-probs,
the fingerprinted weight push) and --check-weight-sync pass; the mixture-of-experts families
replay the engine's routing (R3) in every trainer pass."""

from __future__ import annotations

import json
import re

import pytest
from safetensors import safe_open

from slime.tools.tiny_families import MOE_FAMILIES, NEW_FAMILIES
from slime.utils.model_families import FAMILIES
from tests.conftest import make_model
from tests.test_loop_e2e import prompts, run_job  # noqa: F401 - prompts is a fixture

pytestmark = pytest.mark.e2e


@pytest.mark.slow
@pytest.mark.parametrize("arch", NEW_FAMILIES)
def test_a_grpo_job_of_each_family_passes_the_step_0_gates(prompts, tmp_path, arch):
    model = make_model(str(tmp_path / arch), 0, "--arch", arch, "--hidden-size", "64", "--num-layers", "2")
    proc = run_job(
        "train.py",
        model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--check-precision",
        "--check-weight-sync",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.01",
        "--actor-num-gpus-per-node",
        "2",
        *(["--use-rollout-routing-replay"] if arch in MOE_FAMILIES else []),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    checks = json.loads((tmp_path / "logs" / "precision.json").read_text())["checks"]
    assert checks and all(c["ok"] is not False for c in checks), checks
    # Every push (the checkpoint's tensors, the expert bias included) matched on the engine.
    out = proc.stdout + proc.stderr
    assert len(re.findall(r"--check-weight-sync: (\d+) tensors match on every engine", out)) >= 2, out[-3000:]
    with safe_open(f"{model}/model.safetensors", "pt") as f:
        assert {int(n) for n in re.findall(r"--check-weight-sync: (\d+) tensors match", out)} == {
            len(f.keys())
        }


R3 = "--use-rollout-routing-replay"
MEGATRON_JOBS = {  # the families the Megatron backend builds, each on a layout of its own
    "glm4": ["--tensor-model-parallel-size", "2"],
    "glm4_moe": ["--expert-model-parallel-size", "2", R3],
    # the expert bias moves every step, and every push must still match the engine (R3 with a
    # bias update is refused with Megatron: megatron-core counts its own choice)
    "deepseek_v3": ["--expert-model-parallel-size", "2", "--moe-router-bias-update-rate", "0.001"],
    "glm4_moe_lite": ["--pipeline-model-parallel-size", "2", R3],
    # the hybrids: the delta-nets replicated over TP; over CP, on whole sequences (where the
    # router hooks are refused: a CP rank does not hold whole sequences)
    "qwen3_5": ["--tensor-model-parallel-size", "2"],
    "qwen3_next": ["--expert-model-parallel-size", "2", R3],
    "qwen3_5_moe": ["--context-parallel-size", "2"],
    # the released (vision-language) checkpoints: their language model trained, pushed and
    # checked under the checkpoint's names, the engine serving the whole model
    "qwen3_5_vl": ["--tensor-model-parallel-size", "2"],
    "qwen3_5_moe_vl": ["--expert-model-parallel-size", "2", R3],
}


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(MEGATRON_JOBS))
def test_a_megatron_grpo_job_of_each_built_family_passes_the_step_0_gates(prompts, tmp_path, arch):
    heads = ["--num-heads", "2", "--num-kv-heads", "2"] if arch.endswith("_vl") else []  # (mrope: dim 32)
    model = make_model(
        str(tmp_path / arch), 0, "--arch", arch, "--hidden-size", "64", "--num-layers", "2", *heads
    )
    proc = run_job(
        "train.py",
        model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--check-precision",
        "--check-weight-sync",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.01",
        "--actor-num-gpus-per-node",
        "2",
        "--train-backend",
        "megatron",
        *MEGATRON_JOBS[arch],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    checks = json.loads((tmp_path / "logs" / "precision.json").read_text())["checks"]
    assert checks and all(c["ok"] is not False for c in checks), checks
    out = proc.stdout + proc.stderr
    assert len(re.findall(r"--check-weight-sync: (\d+) tensors match on every engine", out)) >= 2, out[-3000:]


def lora_exclusions(arch: str, backend: str) -> list[str]:
    """What the adapter push of `all-linear` leaves out: multi-latent attention's kv_b_proj, which
    the torch engine computes absorbed (no adapter), and with Megatron the shared-expert gate, a
    parameter inside megatron-core's shared expert."""
    excluded = ["kv_b_proj"] if arch in ("deepseek_v3", "glm4_moe_lite") else []
    if backend == "megatron" and arch in ("qwen3_next", "qwen3_5_moe"):
        excluded.append("shared_expert_gate")
    return ["--exclude-modules", ",".join(excluded)] if excluded else []


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch", [f.arch for f in FAMILIES.values() if f.arch in NEW_FAMILIES and f.megatron is None]
)
@pytest.mark.parametrize("backend", ["fsdp", "megatron"])
def test_a_lora_job_of_each_family_pushes_the_adapter_and_the_engine_serves_it(
    prompts, tmp_path, arch, backend
):
    """--lora-push adapter: the engine applies the trained adapter (trainer and engine log-probs
    agree after the adapters trained), and the sync check passes, with either backend."""
    model = make_model(str(tmp_path / arch), 0, "--arch", arch, "--hidden-size", "64", "--num-layers", "2")
    proc = run_job(
        "train.py",
        model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--lora-rank",
        "8",
        "--lora-alpha",
        "16",
        "--target-modules",
        "all-linear",
        "--lora-push",
        "adapter",
        "--num-rollout",
        "3",
        "--lr",
        "1e-2",
        "--check-weight-sync",
        "--check-precision",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.01",
        "--train-backend",
        backend,
        *lora_exclusions(arch, backend),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    checks = json.loads((tmp_path / "logs" / "precision.json").read_text())["checks"]
    assert checks and all(c["ok"] is not False for c in checks), checks
    out = proc.stderr + proc.stdout
    assert len([line for line in out.splitlines() if "pushed the LoRA adapter 'slime_lora'" in line]) == 4
    records = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    # After two steps of lr 1e-2 the adapters have moved the policy: the engine's log-probs are
    # still the trainer's only because it sampled with the adapter.
    last = records[-1]
    assert last["rollout_id"] == 2 and abs(last["train/kl_loss"]) > 1e-6, last
    assert last["rollout/train_rollout_logprob_abs_diff"] < 1e-5, last
