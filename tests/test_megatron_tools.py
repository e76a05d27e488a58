"""The checkpoint conversion tools, run as users run them (subprocesses on real directories)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import make_model


def tool(name: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", f"slime.tools.{name}", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny Qwen2 (QKV bias, tied embeddings) with 4 query groups: TP up to 4."""
    root = tmp_path_factory.mktemp("hf")
    return make_model(
        str(root / "qwen2"),
        3,
        "--arch",
        "qwen2",
        "--num-heads",
        "4",
        "--num-kv-heads",
        "4",
        "--hidden-size",
        "64",
        "--num-layers",
        "3",
    )


@pytest.mark.slow  # ~10 s; the conversion's round trips run in-process in tests/test_megatron_convert.py
def test_hf_to_megatron_reshard_and_back_is_bitwise(hf, tmp_path):
    mg = tmp_path / "mg_tp2_pp3"
    r = tool(
        "convert_hf_to_megatron",
        "--hf-checkpoint",
        hf,
        "--save-dir",
        str(mg),
        "--tensor-model-parallel-size",
        "2",
        "--pipeline-model-parallel-size",
        "3",
        "--make-vocab-size-divisible-by",
        "16",
    )
    assert r.returncode == 0, r.stderr
    vocab = load_file(os.path.join(hf, "model.safetensors"))["model.embed_tokens.weight"].shape[0]
    padded2 = -(-vocab // 32) * 32
    assert f"vocabulary {vocab} padded to {padded2} ({padded2 // 2} rows per TP rank)" in r.stdout
    assert (mg / "latest_checkpointed_iteration.txt").read_text() == "release\n"
    assert sorted(os.listdir(mg / "release")) == [
        f"mp_rank_{t:02d}_{p:03d}" for t in range(2) for p in range(3)
    ]
    first = torch.load(mg / "release" / "mp_rank_01_000" / "model_optim_rng.pt", weights_only=True)
    assert first["model"]["embedding.word_embeddings.weight"].shape[0] == padded2 // 2
    assert first["args"]["tensor_model_parallel_size"] == 2 and first["args"]["padded_vocab_size"] == padded2
    last = torch.load(mg / "release" / "mp_rank_00_002" / "model_optim_rng.pt", weights_only=True)["model"]
    assert "decoder.final_layernorm.weight" in last and "decoder.layers.0.mlp.linear_fc1.weight" in last
    assert "decoder.layers.1.mlp.linear_fc1.weight" not in last  # 3 layers over 3 stages: one each

    tp4 = tmp_path / "mg_tp4_pp1"
    r = tool(
        "convert_checkpoint",
        "--load-dir",
        str(mg),
        "--save-dir",
        str(tp4),
        "--target-tensor-parallel-size",
        "4",
        "--target-pipeline-parallel-size",
        "1",
    )
    assert r.returncode == 0, r.stderr
    padded4 = -(-vocab // 64) * 64
    shard = torch.load(tp4 / "release" / "mp_rank_03" / "model_optim_rng.pt", weights_only=True)["model"]
    assert shard["embedding.word_embeddings.weight"].shape[0] == padded4 // 4  # re-padded for TP 4
    tp1 = tmp_path / "mg_tp1"
    assert (
        tool(
            "convert_checkpoint",
            "--load-dir",
            str(tp4),
            "--save-dir",
            str(tp1),
            "--target-tensor-parallel-size",
            "1",
            "--target-pipeline-parallel-size",
            "1",
        ).returncode
        == 0
    )
    back = tmp_path / "hf_back"
    r = tool("convert_megatron_to_hf", "--load-dir", str(tp1), "--hf-checkpoint", hf, "--save-dir", str(back))
    assert r.returncode == 0, r.stderr
    want, got = load_file(os.path.join(hf, "model.safetensors")), load_file(back / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert (back / "config.json").read_text() == open(os.path.join(hf, "config.json")).read()
    assert (back / "tokenizer.json").exists()


@pytest.mark.slow  # ~12 s; uneven stages' resharding runs in-process in tests/test_megatron_convert.py
def test_uneven_pipeline_stages_convert_and_reshard_bitwise(hf, tmp_path):
    """--decoder-first-pipeline-num-layers 2 with PP 2 (2 + 1 layers), resharded to PP 3 (one each)
    and back to HF: the same tensors; the checkpoint's args record the stages as Megatron-LM's."""
    mg = tmp_path / "mg_pp2_uneven"
    r = tool(
        "convert_hf_to_megatron",
        "--hf-checkpoint",
        hf,
        "--save-dir",
        str(mg),
        "--pipeline-model-parallel-size",
        "2",
        "--decoder-first-pipeline-num-layers",
        "2",
    )
    assert r.returncode == 0, r.stderr
    first = torch.load(mg / "release" / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=True)
    assert first["args"]["decoder_first_pipeline_num_layers"] == 2
    assert "decoder.layers.1.mlp.linear_fc1.weight" in first["model"]
    last = torch.load(mg / "release" / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=True)["model"]
    assert (
        "decoder.layers.0.mlp.linear_fc1.weight" in last
        and "decoder.layers.1.mlp.linear_fc1.weight" not in last
    )
    pp3 = tmp_path / "mg_pp3"
    r = tool(
        "convert_checkpoint",
        "--load-dir",
        str(mg),
        "--save-dir",
        str(pp3),
        "--target-tensor-parallel-size",
        "1",
        "--target-pipeline-parallel-size",
        "3",
    )
    assert r.returncode == 0, r.stderr
    back = tmp_path / "hf_back"
    r = tool("convert_megatron_to_hf", "--load-dir", str(pp3), "--hf-checkpoint", hf, "--save-dir", str(back))
    assert r.returncode == 0, r.stderr
    want, got = load_file(os.path.join(hf, "model.safetensors")), load_file(back / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    r = tool(
        "convert_hf_to_megatron",
        "--hf-checkpoint",
        hf,
        "--save-dir",
        str(tmp_path / "bad"),
        "--pipeline-model-parallel-size",
        "2",
        "--decoder-last-pipeline-num-layers",
        "3",
    )
    assert r.returncode == 2 and "does not split the model's 3 layers" in r.stderr
    assert not (tmp_path / "bad").exists()
    r = tool(
        "convert_hf_to_megatron",
        "--hf-checkpoint",
        hf,
        "--save-dir",
        str(tmp_path / "bad"),
        "--decoder-first-pipeline-num-layers",
        "2",
    )
    assert r.returncode == 2 and "give --pipeline-model-parallel-size > 1" in r.stderr
    assert not (tmp_path / "bad").exists()


def test_a_model_argument_that_disagrees_with_the_config_writes_nothing(hf, tmp_path):
    out = tmp_path / "never"
    r = tool(
        "convert_hf_to_megatron",
        "--hf-checkpoint",
        hf,
        "--save-dir",
        str(out),
        "--num-layers",
        "4",
        "--hidden-size",
        "64",
    )
    assert r.returncode == 2
    assert (
        "--num-layers 4 (the HF config has 3)" in r.stderr
        and "hidden-size" not in r.stderr.split("error:")[1]
    )
    assert not out.exists() and not (tmp_path / "never.partial").exists()
    r = tool(
        "convert_hf_to_megatron",
        "--hf-checkpoint",
        hf,
        "--save-dir",
        str(out),
        "--tensor-model-parallel-size",
        "3",
    )
    assert r.returncode == 2 and "TP 3 must divide" in r.stderr and not out.exists()


def test_megatron_to_hf_refuses_another_models_config_and_an_existing_target(hf, tmp_path):
    mg = tmp_path / "mg"
    assert tool("convert_hf_to_megatron", "--hf-checkpoint", hf, "--save-dir", str(mg)).returncode == 0
    other = make_model(str(tmp_path / "other"), 0, "--hidden-size", "32", "--num-layers", "3")  # a Qwen3
    r = tool(
        "convert_megatron_to_hf",
        "--load-dir",
        str(mg),
        "--hf-checkpoint",
        other,
        "--save-dir",
        str(tmp_path / "x"),
    )
    assert (
        r.returncode == 2
        and "describes another model" in r.stderr
        and "hidden_size: checkpoint 64" in r.stderr
    )
    assert not (tmp_path / "x").exists()
    r = tool(
        "convert_checkpoint",
        "--load-dir",
        str(mg),
        "--save-dir",
        str(mg),
        "--target-tensor-parallel-size",
        "1",
        "--target-pipeline-parallel-size",
        "1",
    )
    assert r.returncode == 2 and "already exists and is not empty" in r.stderr
    r = tool(
        "convert_checkpoint",
        "--load-dir",
        str(tmp_path),
        "--save-dir",
        str(tmp_path / "y"),
        "--target-tensor-parallel-size",
        "1",
        "--target-pipeline-parallel-size",
        "1",
    )
    assert r.returncode == 2 and "not a Megatron checkpoint directory" in r.stderr


# ~10 s; the expert layouts' resharding runs in-process in tests/test_megatron_moe_convert.py
@pytest.mark.slow
def test_moe_checkpoints_move_between_expert_layouts_and_back_bitwise(tiny_moe, tmp_path):
    """Qwen3-MoE: HF -> EP 2 -> TP 2 (ETP 2 by default) -> PP 2 x EP 4 (ETP 1) -> HF, bit for bit,
    with Megatron-LM's file names at each step."""
    ep2 = tmp_path / "ep2"
    r = tool(
        "convert_hf_to_megatron",
        "--hf-checkpoint",
        tiny_moe,
        "--save-dir",
        str(ep2),
        "--expert-model-parallel-size",
        "2",
    )
    assert r.returncode == 0, r.stderr
    assert "TP 1 x PP 1 x EP 2 (ETP 1)" in r.stdout
    assert sorted(os.listdir(ep2 / "release")) == ["mp_rank_00_000", "mp_rank_00_001"]
    one = torch.load(ep2 / "release" / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=True)
    assert one["args"]["expert_model_parallel_size"] == 2
    experts = {k for k in one["model"] if ".mlp.experts." in k}
    assert experts == {
        f"decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc{f}.weight"
        for i in range(2)
        for e in range(2)
        for f in (1, 2)
    }
    tp2 = tmp_path / "tp2"
    r = tool(
        "convert_checkpoint",
        "--load-dir",
        str(ep2),
        "--save-dir",
        str(tp2),
        "--target-tensor-parallel-size",
        "2",
        "--target-pipeline-parallel-size",
        "1",
    )
    assert r.returncode == 0, r.stderr
    assert "TP 1 x PP 1 x EP 2 (ETP 1) -> TP 2 x PP 1 x EP 1 (ETP 2)" in r.stdout
    pp2 = tmp_path / "pp2ep4"
    r = tool(
        "convert_checkpoint",
        "--load-dir",
        str(tp2),
        "--save-dir",
        str(pp2),
        "--target-tensor-parallel-size",
        "1",
        "--target-pipeline-parallel-size",
        "2",
        "--target-expert-model-parallel-size",
        "4",
        "--target-expert-tensor-parallel-size",
        "1",
    )
    assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(pp2 / "release")) == [
        f"mp_rank_00_{s:03d}_{e:03d}" for s in range(2) for e in range(4)
    ]
    back = tmp_path / "hf_back"
    r = tool(
        "convert_megatron_to_hf", "--load-dir", str(pp2), "--hf-checkpoint", tiny_moe, "--save-dir", str(back)
    )
    assert r.returncode == 0, r.stderr
    original, converted = (
        load_file(os.path.join(tiny_moe, "model.safetensors")),
        load_file(back / "model.safetensors"),
    )
    assert original.keys() == converted.keys()
    for name, value in original.items():
        assert torch.equal(converted[name], value), name


def test_a_checkpoint_from_before_layouts_named_their_model_type_converts_back(hf, tmp_path):
    """Checkpoints written before `slime_layout` carried `model_type` (it reads "") still convert
    back to HF against the right config."""
    from slime.tools import convert_hf_to_megatron, convert_megatron_to_hf

    mg = tmp_path / "mg"
    assert convert_hf_to_megatron.main(["--hf-checkpoint", hf, "--save-dir", str(mg)]) == 0
    shard = mg / "release" / "mp_rank_00" / "model_optim_rng.pt"
    blob = torch.load(shard, weights_only=True)
    del blob["args"]["slime_layout"]["model_type"]
    torch.save(blob, shard)
    back = tmp_path / "back"
    assert (
        convert_megatron_to_hf.main(["--load-dir", str(mg), "--hf-checkpoint", hf, "--save-dir", str(back)])
        == 0
    )
    want, got = load_file(os.path.join(hf, "model.safetensors")), load_file(back / "model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
