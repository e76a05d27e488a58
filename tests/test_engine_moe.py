"""A mixture-of-experts model (tiny Qwen3-MoE: 4 experts, top-2) in the torch engine's batched
runner: greedy tokens equal Hugging Face's `generate`, sampled log-probs equal a teacher-forced
forward of the whole sequence within the engine's bound, with several requests batched."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_model
from tests.test_engine_generic import assert_serves_like_hf


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_model(str(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe"), 0, "--arch", "qwen3_moe",
                      "--hidden-size", "64", "--num-layers", "2")  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model


def test_batched_runner_serves_qwen3_moe(moe_model, tmp_path):
    path, model = moe_model
    prompts = [[5, 6, 7], [10, 11, 12, 13, 14, 15], [40], [22, 23, 24, 25]]
    assert_serves_like_hf(path, model, prompts, tmp_path, "BatchedRunner", sampled_tokens=12)
