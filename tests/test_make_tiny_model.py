"""The tiny-model tool: offline loading, determinism, tokenizer coverage, argument errors."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import make_model


def test_checkpoint_loads_offline(tiny_model):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert os.path.isfile(os.path.join(tiny_model, name))
    config = AutoConfig.from_pretrained(tiny_model)
    assert config.model_type == "qwen3"
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    n = sum(p.numel() for p in model.parameters())
    assert 1_000_000 < n < 10_000_000
    tok = AutoTokenizer.from_pretrained(tiny_model)
    assert len(tok) <= config.vocab_size


def test_tokenizer_covers_demo_alphabet(tokenizer):
    text = "What is 12+7*3-(4/2)? Answer: 29 = x^2 % y, abc XYZ.\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1+1"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\n1+1<|im_end|>\n<|im_start|>assistant\n"
    special = tokenizer.encode(chat, add_special_tokens=False)
    assert special[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"


def test_same_seed_same_bytes(tmp_path, tiny_model):
    again = make_model(str(tmp_path / "again"), 0)
    for name in sorted(os.listdir(tiny_model)):
        assert filecmp.cmp(os.path.join(tiny_model, name), os.path.join(again, name), shallow=False), name
    other = make_model(str(tmp_path / "other"), 1)
    assert not filecmp.cmp(
        os.path.join(tiny_model, "model.safetensors"), os.path.join(other, "model.safetensors"), shallow=False
    )


def test_qwen2_and_custom_sizes(tmp_path):
    from transformers import AutoModelForCausalLM

    out = make_model(
        str(tmp_path / "q2"),
        0,
        "--arch",
        "qwen2",
        "--hidden-size",
        "64",
        "--num-layers",
        "2",
        "--num-heads",
        "4",
        "--num-kv-heads",
        "1",
        "--vocab",
        "128",
    )
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen2" and model.config.vocab_size == 128
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 128)


def test_qwen3_moe_checkpoint(tmp_path):
    """A tiny Qwen3-MoE: routed experts in every layer, per-expert tensors on disk (the hub's
    layout), loadable and deterministic."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    args = ("--arch", "qwen3_moe", "--hidden-size", "64", "--num-layers", "2", "--num-experts", "4")
    out = make_model(str(tmp_path / "moe"), 0, *args)
    model = AutoModelForCausalLM.from_pretrained(out)
    config = model.config
    assert (config.model_type, config.num_experts, config.num_experts_per_tok) == ("qwen3_moe", 4, 2)
    assert config.moe_intermediate_size == 32 and config.norm_topk_prob and config.head_dim == 16
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for layer in range(2):
        assert f"model.layers.{layer}.mlp.gate.weight" in keys
        for e in range(4):
            assert f"model.layers.{layer}.mlp.experts.{e}.down_proj.weight" in keys
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, config.vocab_size)
    again = make_model(str(tmp_path / "again"), 0, *args)
    assert filecmp.cmp(
        os.path.join(out, "model.safetensors"), os.path.join(again, "model.safetensors"), shallow=False
    )


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--num-experts", "4"], "--arch qwen3_moe"),
        (["--arch", "qwen3_moe", "--num-experts-per-tok", "5"], "--num-experts-per-tok"),
        (["--num-heads", "3"], "--hidden-size"),
        (["--vocab", "10"], "--vocab"),
        (["--num-kv-heads", "3"], "--num-kv-heads"),
    ],
)
def test_bad_arguments_exit_2(tmp_path, args, needle):
    proc = subprocess.run(
        [sys.executable, "-m", "slime.tools.make_tiny_model", "--out", str(tmp_path / "x"), *args],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and needle in proc.stderr
    assert not (tmp_path / "x").exists()
