"""Two GRPO steps with real SGLang servers on a GPU machine, colocated and disaggregated, with the
step-0 precision gates on (skipped without CUDA, SGLang and sglang-router).

Run on a GPU machine: `pytest -m gpu tests/test_sglang_gpu.py` (the model: a tiny Qwen3 built
locally by slime.tools.make_tiny_model, or SLIME_GPU_TEST_MODEL=/path/to/an/HF/checkpoint).
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.test_loop_e2e import prompts, run_job  # noqa: F401 - fixture

pytestmark = pytest.mark.gpu

if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("sglang_router") is None:
    pytest.skip("needs sglang and sglang-router installed", allow_module_level=True)


@pytest.fixture(scope="module")
def model(tiny_model):
    return os.environ.get("SLIME_GPU_TEST_MODEL") or tiny_model


@pytest.mark.parametrize(
    "layout",
    [
        ["--colocate", "--actor-num-gpus-per-node", "1"],  # CUDA-IPC push, memory released and resumed
        ["--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"],  # NCCL push
    ],
    ids=["colocated", "disaggregated"],
)
def test_two_grpo_steps_with_sglang_engines(model, prompts, tmp_path, layout):
    import torch

    if torch.cuda.device_count() < (1 if "--colocate" in layout else 2):
        pytest.skip("not enough GPUs for this layout")
    proc = run_job(
        "train.py",
        model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--device",
        "cuda",
        "--rollout-backend",
        "sglang",
        "--train-backend",
        "fsdp",
        "--advantage-estimator",
        "grpo",
        "--check-precision",
        "--check-weight-update-equal",
        "--sglang-mem-fraction-static",
        "0.3",
        *layout,
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "--check-precision: passed at rollout 0" in proc.stderr
    assert "after the first push every engine parameter equals the checkpoint" in proc.stderr
