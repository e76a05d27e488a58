"""A non-Llama architecture (GPT-2) served by the generic per-sequence runner."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

from slime.engines.client import EngineClient
from tests.conftest import start_engine
from tests.test_engine_server import teacher_forced_logprobs


@pytest.fixture(scope="module")
def gpt2_model(tiny_model, tmp_path_factory):
    from transformers import GPT2Config, GPT2LMHeadModel

    out = tmp_path_factory.mktemp("models") / "tiny-gpt2"
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=101,
            n_embd=64,
            n_layer=2,
            n_head=2,
            n_positions=256,
            eos_token_id=2,
            bos_token_id=2,
            pad_token_id=0,
        )
    )
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(f"{tiny_model}/{name}", out / name)
    model.eval()
    return str(out), model


def test_generic_runner_greedy_and_logprobs(gpt2_model, tmp_path):
    path, model = gpt2_model
    assert_serves_like_hf(path, model, [[5, 6, 7], [10, 11, 12, 13, 14, 15], [40]], tmp_path, "GenericRunner")


def assert_serves_like_hf(path, model, prompts, log_dir, runner, sampled_tokens=10):
    """An engine on `path` batches `prompts` with `runner`: greedy tokens equal Hugging Face's
    `generate` (10 tokens), sampled log-probs equal a teacher-forced forward within 1e-5."""
    with start_engine(path, log_dir) as eng:

        async def scenario():
            async with EngineClient(eng.url) as c:
                info = await c.get_server_info()
                greedy = await c.generate(
                    prompts, sampling_params={"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
                )
                sampled = await c.generate(
                    prompts,
                    sampling_params={
                        "max_new_tokens": sampled_tokens,
                        "temperature": 0.8,
                        "ignore_eos": True,
                    },
                    return_logprob=True,
                )
                return info, greedy, sampled

        info, greedy, sampled = asyncio.run(scenario())
    assert info["runner"] == runner
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
