"""slime.utils.flops: the FLOPs count against hand counts and against the weights of transformers
models built from the same configs (on the meta device), the attention term, the GPU peak table
and the perf/* metrics of a train call."""

from __future__ import annotations

import math

import pytest
import torch

from slime.backends.perf import PassClock, StepPerf
from slime.utils import flops
from tests.fixtures.hf_configs import HF_CONFIGS

# A tiny Qwen3: heads x head_dim (4 x 32 = 128) differs from hidden (64), as in the released
# Qwen3 models, so q and o must be counted with 128, not 64.
TINY_QWEN3 = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 96,
    "vocab_size": 101,
    "tie_word_embeddings": True,
    "use_sliding_window": False,
}

TINY_QWEN3_MOE = {
    **TINY_QWEN3,
    "model_type": "qwen3_moe",
    "num_hidden_layers": 3,
    "head_dim": 16,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "mlp_only_layers": [1],
    "decoder_sparse_step": 1,
    "tie_word_embeddings": False,
}


def meta_model(config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config), hf_config


def test_tiny_qwen3_by_hand():
    counted = flops.from_config(TINY_QWEN3)
    assert counted is not None and counted.source == "config"
    q, kv, o = 64 * 4 * 32, 2 * 64 * 2 * 32, 4 * 32 * 64
    mlp = 3 * 64 * 96  # gate, up, down
    head = 64 * 101  # tied to the embedding: still a matmul (the embedding lookup is not)
    assert counted.matmul_params == 2 * (q + kv + o + mlp) + head == 92480
    # Per layer and head, causal QK^T and AV: 2 x (32 + 32) FLOPs per query-key pair, s^2 / 2 pairs.
    attention = [2 * 2 * 4 * (32 + 32) * s * s / 2 for s in (10, 6)]
    expected = 2 * 92480 * (10 + 6) + sum(attention)
    assert counted.forward_flops([10, 6]) == expected == 3028992
    assert counted.train_flops([10, 6]) == 3 * expected


def test_tiny_qwen3_matches_the_linear_layers_of_the_transformers_model():
    model, hf_config = meta_model(TINY_QWEN3)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert flops.from_config(hf_config).matmul_params == linear  # the config object as the dict
    assert flops.from_config(TINY_QWEN3).matmul_params == linear == flops.active_parameters(model, hf_config)


@pytest.mark.parametrize(
    "name",
    [
        "qwen2.5-7B",
        "qwen3-4B",
        "llama3.2-1B",
        "glm4-9B",
        "qwen3-30B-A3B",
        "deepseek-v3",
        "glm4.5-106B-A12B",
        "glm4.7-30B-A3B",
    ],
)
def test_published_configs_match_their_models_active_weights(name):
    """Dense (tied and untied), Qwen3-MoE, DeepSeek-V3's latent attention and shared experts,
    GLM-4.5's and GLM-4.7-Flash's layer kinds: the count from config.json equals the weights of
    the model transformers builds from it, routed experts scaled by top-k / experts."""
    model, hf_config = meta_model(HF_CONFIGS[name])
    assert flops.from_config(HF_CONFIGS[name]).matmul_params == flops.active_parameters(model, hf_config)


def test_published_active_parameter_counts():
    """DeepSeek-V3: 37B activated parameters per token (its model card), of which the embedding
    is 0.9B; Qwen3-30B-A3B: 3.3B activated, 0.3B of them the embedding."""
    assert 36.0e9 < flops.from_config(HF_CONFIGS["deepseek-v3"]).matmul_params < 37.0e9
    assert 2.9e9 < flops.from_config(HF_CONFIGS["qwen3-30B-A3B"]).matmul_params < 3.1e9


def test_mixture_of_experts_counts_only_the_routed_and_shared_experts():
    counted = flops.from_config(TINY_QWEN3_MOE)
    attention = 64 * 4 * 16 + 2 * 64 * 2 * 16 + 4 * 16 * 64
    sparse = 64 * 8 + 3 * 64 * 32 * 2  # the router over 8 experts, 2 experts of width 32
    dense = 3 * 64 * 128  # layer 1 (mlp_only_layers)
    assert counted.matmul_params == 3 * attention + 2 * sparse + dense + 64 * 101
    more = flops.from_config({**TINY_QWEN3_MOE, "num_experts": 64})  # 8x the experts, same top-k
    assert more.matmul_params - counted.matmul_params == 2 * 64 * (64 - 8)  # the routers only
    shared = flops.from_config(
        {**TINY_QWEN3_MOE, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 48}
    )
    assert shared.matmul_params - counted.matmul_params == 2 * (
        3 * 64 * 48 + 64
    )  # shared expert and its gate
    model, hf_config = meta_model(TINY_QWEN3_MOE)
    assert counted.matmul_params == flops.active_parameters(model, hf_config)


def test_attention_grows_with_each_sequences_own_length():
    counted = flops.from_config(TINY_QWEN3)
    n, heads, head_dim, layers = counted.matmul_params, 4, 32, 2

    def attention(s: int) -> float:
        return counted.train_flops([s]) - 6 * n * s

    # per token and training step: 6 x layers x heads x head_dim x s (PaLM's 12, halved: causal)
    for s in (1, 7, 100):
        assert attention(s) / s == 6 * layers * heads * head_dim * s
    assert attention(200) == 4 * attention(100)
    # packed sequences are counted each on its own: two of 50 cost less than one of 100
    assert counted.train_flops([50, 50]) == 2 * counted.train_flops([50]) < counted.train_flops([100])


def test_sliding_window_attention_grows_linearly_past_the_window():
    mistral = {k: v for k, v in TINY_QWEN3.items() if k != "use_sliding_window"}  # Qwen's switch
    windowed = flops.from_config({**mistral, "model_type": "mistral", "sliding_window": 8})
    full = flops.from_config(TINY_QWEN3)
    assert windowed.forward_flops([8]) == full.forward_flops([8])
    extra = [windowed.forward_flops([s + 1]) - windowed.forward_flops([s]) for s in (20, 40)]
    assert extra[0] == extra[1] < full.forward_flops([41]) - full.forward_flops([40])


def test_an_unknown_family_falls_back_to_its_active_parameters():
    """Qwen3.5's gated delta-nets are not counted from the config: 2 FLOPs per active weight and
    token, attention only in the full-attention layers."""
    config = HF_CONFIGS["qwen3.5-35B-A3B"]
    assert flops.from_config(config) is None
    model, hf_config = meta_model(config)
    perf = StepPerf(hf_config, torch.device("cpu"), None)
    assert perf.model_flops is not None and perf.model_flops.source == "parameters"
    assert perf.model_flops.matmul_params == flops.active_parameters(model, hf_config)
    full_layers = sum(kind == "full_attention" for kind in config["layer_types"])
    width = full_layers * 2 * config["num_attention_heads"] * config["head_dim"]
    assert perf.model_flops.attention == ((width, None),)


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA H20", 148.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA GB200", 2500.0),
        ("NVIDIA GeForce RTX 4090", None),
        ("", None),
        (None, None),
    ],
)
def test_peak_by_device_name(name, peak):
    assert flops.peak_tflops(name) == peak


def test_step_perf_as_slime_defines_it():
    counted = flops.ModelFlops(matmul_params=10**9)
    lengths = [1000, 3000]  # every sample of the rollout, all replicas
    out = flops.step_perf(counted, lengths, 4, {"actor_train": 2.0, "log_probs": 0.5}, peak=100.0)
    forward_per_gpu = 2 * 10**9 * 4000 / 4 / 1e12
    assert out["actor_train_tok_per_s"] == 4000 / 2.0  # over all replicas, not per GPU
    assert math.isclose(out["actor_train_tflops"], 3 * forward_per_gpu / 2.0)
    assert math.isclose(out["log_probs_tflops"], forward_per_gpu / 0.5)
    assert "ref_log_probs_tflops" not in out  # no reference pass ran
    assert out["actor_train_mfu"] == out["actor_train_tflops"] / 100.0
    assert "actor_train_mfu" not in flops.step_perf(counted, lengths, 4, {"actor_train": 2.0})
    assert flops.step_perf(None, lengths, 4, {"actor_train": 2.0}) == {"actor_train_tok_per_s": 2000.0}
    assert flops.step_perf(counted, lengths, 4, {}) == {}  # nothing trained (--num-critic-only-steps)


def test_pass_clock_sums_each_pass_and_a_cpu_has_no_peak():
    clock = PassClock(torch.device("cpu"))
    for _ in range(2):
        with clock("actor_train"):
            pass
    assert list(clock.seconds) == ["actor_train"] and clock.seconds["actor_train"] >= 0
    assert StepPerf(TINY_QWEN3, torch.device("cpu"), None).peak is None
    assert StepPerf(TINY_QWEN3, torch.device("cpu"), 50.0).peak == 50.0
