"""make_tiny_model --preset: released Qwen shapes with random weights, checked against the published
config.json values (written out here, not read from the tool's table)."""

from __future__ import annotations

import filecmp
import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import make_model

# From each model's config.json on the Hugging Face hub (Qwen/Qwen3-0.6B, Qwen/Qwen2.5-0.5B,
# Qwen/Qwen3-1.7B). Qwen2's config has no head_dim: its head dim is hidden / heads (896 / 14).
PUBLISHED = {
    "qwen3-0.6b": dict(
        model_type="qwen3",
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=32768,
    ),
    "qwen3-1.7b": dict(
        model_type="qwen3",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
    ),
}
SHARED = dict(
    vocab_size=151936, tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1e6, dtype="bfloat16"
)


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory):
    """Builds each preset with one layer, once per module (the 151936-row embedding is most of it)."""
    built: dict[str, str] = {}

    def build(preset: str) -> str:
        if preset not in built:
            out = str(tmp_path_factory.mktemp("presets") / preset)
            built[preset] = make_model(out, 0, "--preset", preset, "--num-layers", "1")
        return built[preset]

    return build


def _tensors(path: str) -> dict[str, tuple[list[int], str]]:
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return {k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def _assert_published(config: dict, preset: str, **overrides) -> None:
    want = {**PUBLISHED[preset], **SHARED, **overrides}
    got = {key: config.get(key) for key in want}
    got["head_dim"] = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    got["rope_theta"] = config["rope_parameters"]["rope_theta"]
    assert got == want
    assert config["rope_parameters"]["rope_type"] == "default"


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_every_preset_config_is_the_published_one(preset):
    """The whole depth, without building weights (milliseconds)."""
    from slime.tools.make_tiny_model import build_config, build_tokenizer, parse_args

    args, _ = parse_args(["--out", "unused", "--preset", preset])
    config = build_config(args, args.vocab, build_tokenizer()).to_dict()
    _assert_published(config, preset)


# The 1.7B's one layer and its 2048-wide embedding take ~9 s on one core: in the slow tier.
@pytest.mark.parametrize(
    "preset", ["qwen3-0.6b", "qwen2.5-0.5b", pytest.param("qwen3-1.7b", marks=pytest.mark.slow)]
)
def test_preset_writes_the_published_config(one_layer, preset):
    path = one_layer(preset)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    _assert_published(config, preset, num_hidden_layers=1)  # --num-layers 1 overrides the 28 / 24
    want = {**PUBLISHED[preset], **SHARED}

    tensors = _tensors(path)
    assert {dtype for _, dtype in tensors.values()} == {"BF16"}
    hidden, head_dim = want["hidden_size"], want["head_dim"]
    attn = "model.layers.0.self_attn."
    assert tensors["model.embed_tokens.weight"][0] == [151936, hidden]
    assert "lm_head.weight" not in tensors  # tied
    assert tensors[attn + "q_proj.weight"][0] == [want["num_attention_heads"] * head_dim, hidden]
    assert tensors[attn + "k_proj.weight"][0] == [want["num_key_value_heads"] * head_dim, hidden]
    assert tensors["model.layers.0.mlp.gate_proj.weight"][0] == [want["intermediate_size"], hidden]
    qwen2 = want["model_type"] == "qwen2"  # Qwen2 has q/k/v biases, Qwen3 q/k norms instead
    assert (attn + "q_proj.bias" in tensors) == qwen2 and (attn + "q_norm.weight" in tensors) != qwen2


@pytest.mark.parametrize("preset", ["qwen3-0.6b", "qwen2.5-0.5b"])
def test_preset_loads_and_decodes_beyond_the_tokenizer(one_layer, preset):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = one_layer(preset)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.dtype == torch.bfloat16
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 151936)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) < 200
    # The engine samples from all 151936 logits: an id the tokenizer lacks decodes to nothing.
    assert tokenizer.decode([150000]) == ""
    assert tokenizer.decode([tokenizer.convert_tokens_to_ids("7"), 150000]) == "7"


def test_flags_override_the_preset():
    from slime.tools.make_tiny_model import parse_args

    args, _ = parse_args(["--out", "x", "--preset", "qwen3-0.6b", "--num-layers", "2", "--dtype", "float32"])
    assert (args.num_layers, args.dtype, args.hidden_size, args.head_dim, args.vocab) == (
        2,
        "float32",
        1024,
        128,
        151936,
    )
    args, _ = parse_args(["--out", "x", "--preset", "qwen2.5-0.5b", "--arch", "qwen2"])  # the same arch: fine
    assert (args.arch, args.num_layers, args.head_dim, args.rope_theta) == ("qwen2", 24, None, 1e6)
    args, _ = parse_args(["--out", "x"])  # no preset: the tool's own defaults
    assert (args.hidden_size, args.head_dim, args.rope_theta, args.dtype) == (256, None, None, "float32")


def test_bfloat16_is_the_float32_build_rounded(tmp_path):
    """--dtype casts after the float32 build: the same seed gives the float32 weights rounded, and the
    same bytes twice."""
    from safetensors.torch import load_file

    small = ("--hidden-size", "64", "--num-layers", "1", "--head-dim", "32", "--rope-theta", "500000")
    f32 = load_file(os.path.join(make_model(str(tmp_path / "f32"), 0, *small), "model.safetensors"))
    bf16_dir = make_model(str(tmp_path / "bf16"), 0, *small, "--dtype", "bfloat16")
    bf16 = load_file(os.path.join(bf16_dir, "model.safetensors"))
    assert f32.keys() == bf16.keys()
    for name, tensor in f32.items():
        assert torch.equal(tensor.to(torch.bfloat16), bf16[name]), name
    assert bf16["model.layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    again = make_model(str(tmp_path / "again"), 0, *small, "--dtype", "bfloat16")
    for name in sorted(os.listdir(bf16_dir)):
        assert filecmp.cmp(os.path.join(bf16_dir, name), os.path.join(again, name), shallow=False), name


@pytest.mark.parametrize(
    "args,needles",
    [
        (["--preset", "qwen3-0.6b", "--arch", "qwen2"], ["--preset qwen3-0.6b", "--arch qwen2"]),
        (["--preset", "qwen2.5-0.5b", "--arch", "qwen3_moe"], ["--preset qwen2.5-0.5b", "--arch qwen3_moe"]),
        (["--preset", "llama-7b"], ["--preset", "invalid choice"]),
        (["--arch", "qwen2", "--head-dim", "32"], ["--head-dim"]),
        (["--arch", "glm4", "--rope-theta", "5"], ["--rope-theta"]),
        (["--head-dim", "0"], ["--head-dim must be positive"]),
    ],
)
def test_bad_preset_arguments_exit_2(tmp_path, args, needles):
    proc = subprocess.run(
        [sys.executable, "-m", "slime.tools.make_tiny_model", "--out", str(tmp_path / "x"), *args],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2, proc.stderr
    for needle in needles:
        assert needle in proc.stderr
    assert not (tmp_path / "x").exists()


def _qwen2_parameters(vocab, hidden, inter, layers, heads, kv_heads) -> int:
    """Qwen2's parameter count with tied embeddings, from its shapes."""
    head_dim = hidden // heads
    attention = (hidden + 1) * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden  # q/k/v biased
    layer = attention + 3 * hidden * inter + 2 * hidden  # gate/up/down, two norms
    return vocab * hidden + layers * layer + hidden  # embedding (= head), layers, final norm


@pytest.mark.slow  # the whole 0.5B model (~2 GB of float32 while it is built)
def test_qwen2_5_0_5b_whole_has_the_published_parameter_count(tmp_path):
    from slime.tools.make_tiny_model import main

    shapes = _qwen2_parameters(151936, 896, 4864, 24, 14, 2)
    assert shapes == 494_032_768  # Qwen2.5-0.5B's published count
    out = str(tmp_path / "q25")
    assert main(["--out", out, "--preset", "qwen2.5-0.5b"]) == 0
    assert sum(n for shape, _ in _tensors(out).values() for n in [torch.Size(shape).numel()]) == shapes
