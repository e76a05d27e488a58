"""slime.tinker with --device cuda (skipped without CUDA): the trainer's forward against Hugging
Face's on the CPU, a step, and a sampler of the saved weights against the trainer's log-probs.

Run on a GPU machine: python -m pytest -m gpu -s tests/test_tinker_gpu.py
"""

from __future__ import annotations

import pytest
import tinker
import torch

from tests.test_tinker import (
    KEY,
    TOKENS,
    datum,
    hf_log_probs,
    log_probs,
    sequence_log_probs,
    start_server,
    stop,
)
from tests.test_tinker import weights as token_weights

pytestmark = pytest.mark.gpu


def test_the_service_on_cuda_trains_and_samples_what_it_trained(tiny_model, tmp_path):
    from tinker import types

    proc, url = start_server(tiny_model, str(tmp_path / "store"), "--device", "cuda")
    try:
        tc = tinker.ServiceClient(base_url=url, api_key=KEY).create_lora_training_client(
            base_model="tiny", rank=4
        )
        tokens = TOKENS[0]
        data = [datum(tokens, weights=token_weights(tokens))]
        first = tc.forward_backward(data, "cross_entropy").result()
        gap = (log_probs(first) - hf_log_probs(tiny_model, tokens)).abs().max()
        print(f"max |trainer on cuda - HF on cpu| log-prob: {float(gap):.3g}")
        assert gap < 1e-4  # float32 on both; cuBLAS against the CPU's kernels
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        assert tc.forward(data, "cross_entropy").result().metrics["loss:sum"] < first.metrics["loss:sum"]
        prompt = [5, 9, 11]
        sampler = tc.save_weights_and_get_sampling_client()
        seq = sampler.sample(
            types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=6, seed=1)
        )
        seq = seq.result().sequences[0]
        diff = (torch.tensor(seq.logprobs) - sequence_log_probs(tc, prompt, seq.tokens)).abs().max()
        print(f"max |sampler - trainer| log-prob on cuda: {float(diff):.3g}")
        assert diff < 1e-4
    finally:
        stop(proc)
