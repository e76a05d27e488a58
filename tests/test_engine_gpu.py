"""GPU checks of the torch engine (skipped without CUDA): cuda device, log-prob parity, NCCL updates."""

from __future__ import annotations

import asyncio

import pytest
import torch

from slime.engines.client import EngineClient
from tests.conftest import start_engine
from tests.test_engine_server import teacher_forced_logprobs

pytestmark = pytest.mark.gpu


def test_cuda_engine_logprob_parity(tiny_model, hf_model, tmp_path):
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    with start_engine(tiny_model, tmp_path, "--device", "cuda") as eng:

        async def scenario():
            async with EngineClient(eng.url) as c:
                return await c.generate(
                    prompts, sampling_params={"max_new_tokens": 16, "ignore_eos": True}, return_logprob=True
                )

        results = asyncio.run(scenario())
    for prompt, res in zip(prompts, results, strict=True):
        got = torch.tensor([lp for lp, _, _ in res["meta_info"]["output_token_logprobs"]])
        ref = teacher_forced_logprobs(hf_model, prompt, res["output_ids"], 1.0)
        # TF32 / kernel differences on GPU: looser than the CPU bound.
        assert (got - ref).abs().max().item() < 1e-3
