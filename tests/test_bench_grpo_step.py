"""benchmarks/bench_grpo_step.py's memory roofline, by hand (its whole run is a slow smoke test in
tests/test_benchmarks_smoke.py)."""

from __future__ import annotations

import pytest

from benchmarks.bench_grpo_step import bandwidth_gbs, roofline_seconds


def test_the_roofline_reads_the_weights_and_every_live_sequences_keys_once_per_step():
    # 2 layers x 1 KV head x head dim 4 x (K, V) x 2 bytes = 32 bytes of K/V per token; 200 bytes of
    # weights. Step 1: both sequences live, 4 + 6 tokens of K/V; step 2: the first only, 5 tokens.
    config = {
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "hidden_size": 8,
        "_num_parameters": 100,
        "_engine_dtype": "bfloat16",
    }
    seconds = roofline_seconds(config, prompts=[3, 5], responses=[2, 1], bandwidth=1.0)
    assert seconds == pytest.approx((200 + 32 * 10 + 200 + 32 * 5) / 1e9)
    config["_engine_dtype"] = "float32"  # every byte count doubles
    assert roofline_seconds(config, [3, 5], [2, 1], 1.0) == pytest.approx(2 * seconds)


def test_known_gpus_have_their_bandwidth():
    assert bandwidth_gbs("NVIDIA H100 80GB HBM3") == 3350.0
    assert bandwidth_gbs("NVIDIA H100 PCIe") == 2000.0
    assert bandwidth_gbs("NVIDIA H200") == 4800.0
    assert bandwidth_gbs("NVIDIA A100-SXM4-80GB") == 2039.0
    assert bandwidth_gbs("NVIDIA GeForce GTX 1080") is None
