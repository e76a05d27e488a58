"""A mixture-of-experts model (tiny Qwen3-MoE: 4 experts, top-2) in the torch engine's batched
runner: greedy tokens equal Hugging Face's `generate`, sampled log-probs equal a teacher-forced
forward of the whole sequence within the engine's bound, with several requests batched."""

from __future__ import annotations

import asyncio

import pytest
import torch

from slime.engines.client import EngineClient
from tests.conftest import make_model, start_engine
from tests.test_engine_server import teacher_forced_logprobs


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
    with start_engine(path, tmp_path) as eng:

        async def scenario():
            async with EngineClient(eng.url) as c:
                info = await c.get_server_info()
                greedy = await c.generate(
                    prompts, sampling_params={"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
                )
                sampled = await c.generate(
                    prompts,
                    sampling_params={"max_new_tokens": 12, "temperature": 0.8, "ignore_eos": True},
                    return_logprob=True,
                )
                return info, greedy, sampled

        info, greedy, sampled = asyncio.run(scenario())
    assert info["runner"] == "BatchedRunner"
    for prompt, res in zip(prompts, greedy, strict=True):
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert res["output_ids"] == out[0, len(prompt) :].tolist()
    for prompt, res in zip(prompts, sampled, strict=True):
        got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
        ref = teacher_forced_logprobs(model, prompt, res["output_ids"], 0.8)
        assert (got - ref).abs().max().item() < 1e-5
