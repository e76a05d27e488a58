"""slime.tools.text_model: Qwen3.5's text model taken out of the released vision-language
checkpoint (what the Megatron backend and LoRA build) and a trained one put back, on a tiny
checkpoint in the released layout, sharded, with an MTP tensor beside the models."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from slime.tools.text_model import main
from tests.conftest import make_model

SIZE = ["--hidden-size", "64", "--num-heads", "2", "--num-kv-heads", "1", "--num-layers", "2"]


def _tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, name)))
    return out


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> str:
    """A tiny Qwen3.5 checkpoint saved in several shards, with an `mtp.*` tensor as the released
    checkpoints carry (transformers skips them on load)."""
    from transformers import AutoModelForImageTextToText

    root = tmp_path_factory.mktemp("released")
    one = make_model(str(root / "one"), 0, "--arch", "qwen3_5_vl", *SIZE)
    model = AutoModelForImageTextToText.from_pretrained(one, dtype=torch.float32)
    path = str(root / "sharded")
    model.save_pretrained(path, max_shard_size="300KB")
    for name in os.listdir(one):  # the tokenizer and the image processor
        if not name.endswith(".safetensors") and not os.path.exists(os.path.join(path, name)):
            shutil.copy(os.path.join(one, name), os.path.join(path, name))
    save_file({"mtp.fc.weight": torch.randn(64, 128)}, os.path.join(path, "mtp.safetensors"))
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    index["weight_map"]["mtp.fc.weight"] = "mtp.safetensors"  # as the released index lists its MTP shard
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    return path


def original_model(path):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()


def _text_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float()


def test_extract_writes_the_text_model_transformers_loads_and_computes_alike(released, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    assert len([n for n in os.listdir(released) if n.startswith("model-")]) > 1
    text = str(tmp_path / "text")
    assert main(["extract", "--hf-checkpoint", released, "--out", text]) == 0
    counts = json.loads(capsys.readouterr().out)["tensors"]
    config = json.load(open(f"{text}/config.json"))
    assert config["model_type"] == "qwen3_5_text" and config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert not os.path.exists(f"{text}/preprocessor_config.json") and os.path.exists(f"{text}/tokenizer.json")
    tensors = _tensors(text)
    vl = _tensors(released)
    assert counts == {"kept": len(tensors), "vision tower": sum(k.startswith("model.visual.") for k in vl)}
    assert "mtp.fc.weight" in tensors and not any("visual" in k or "language_model" in k for k in tensors)
    assert torch.equal(
        tensors["model.layers.0.linear_attn.in_proj_qkv.weight"],
        vl["model.language_model.layers.0.linear_attn.in_proj_qkv.weight"],
    )
    index = json.load(open(f"{text}/model.safetensors.index.json"))
    assert set(index["weight_map"]) == set(tensors)
    model, info = AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and type(model).__name__ == "Qwen3_5ForCausalLM"
    vlm = AutoModelForImageTextToText.from_pretrained(released, dtype=torch.float32).eval()
    ids = [5, 17, 33, 2, 60, 41, 9]
    assert (_text_logits(model.eval(), ids) - _text_logits(vlm, ids)).abs().max().item() < 1e-5


def test_the_megatron_backend_builds_the_extracted_text_model(released, tmp_path):
    pytest.importorskip("megatron.core")
    from transformers import AutoConfig

    from slime.backends.megatron.convert import Layout
    from slime.tools.convert_hf_to_megatron import main as convert

    text = str(tmp_path / "text")
    assert main(["extract", "--hf-checkpoint", released, "--out", text]) == 0
    assert Layout.from_hf_config(AutoConfig.from_pretrained(text)).num_layers == 2
    assert convert(["--hf-checkpoint", text, "--save-dir", str(tmp_path / "mcore")]) == 0


def test_merge_puts_a_trained_text_model_back(released, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    text = str(tmp_path / "text")
    assert main(["extract", "--hf-checkpoint", released, "--out", text]) == 0
    trained = AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01 * torch.randn_like(p))
    trained.to(torch.bfloat16).save_pretrained(str(tmp_path / "trained"))  # as --save-hf writes it: no mtp.*
    save_file(
        {"x": torch.zeros(1)}, str(tmp_path / "trained" / "adapter_model.safetensors")
    )  # not its weights
    capsys.readouterr()
    out = str(tmp_path / "merged")
    assert (
        main(["merge", "--text", str(tmp_path / "trained"), "--hf-checkpoint", released, "--out", out]) == 0
    )
    counts = json.loads(capsys.readouterr().out)["tensors"]
    merged, original = _tensors(out), _tensors(released)
    assert merged.keys() == original.keys() and counts["other, kept"] == 1  # mtp.fc.weight, from the original
    assert all(
        merged[k].dtype == original[k].dtype for k in original
    )  # bfloat16 weights, float32 as the original
    assert torch.equal(merged["mtp.fc.weight"], original["mtp.fc.weight"])
    assert all(torch.equal(merged[k], original[k]) for k in original if k.startswith("model.visual."))
    assert json.load(open(f"{out}/config.json")) == json.load(open(f"{released}/config.json"))
    assert os.path.exists(f"{out}/preprocessor_config.json")
    vlm = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32).eval()
    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"), dtype=torch.float32).eval()
    ids = [5, 17, 33, 2, 60, 41, 9]
    assert (_text_logits(vlm, ids) - _text_logits(saved, ids)).abs().max().item() < 1e-5
    assert (_text_logits(vlm, ids) - _text_logits(original_model(released), ids)).abs().max().item() > 1e-3


def test_bad_input_exits_2_naming_it_and_writes_nothing(released, tiny_model, tmp_path, capsys):
    out = tmp_path / "out"

    def refused(argv: list[str]) -> str:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and not out.exists()
        assert not [n for n in os.listdir(tmp_path) if n.startswith(".out.")]  # no staging left behind
        return capsys.readouterr().err

    err = refused(["extract", "--hf-checkpoint", tiny_model, "--out", str(out)])
    assert (
        "is model_type 'qwen3': this tool takes the vision-language checkpoints qwen3_5, qwen3_5_moe" in err
    )
    err = refused(["merge", "--text", tiny_model, "--hf-checkpoint", released, "--out", str(out)])
    assert "is model_type 'qwen3'; --hf-checkpoint" in err and "text model is 'qwen3_5_text'" in err
    other = make_model(
        str(tmp_path / "other"),
        0,
        "--arch",
        "qwen3_5",
        "--hidden-size",
        "96",
        "--num-heads",
        "2",
        "--num-kv-heads",
        "1",
        "--num-layers",
        "2",
    )
    capsys.readouterr()
    err = refused(["merge", "--text", other, "--hf-checkpoint", released, "--out", str(out)])
    assert re.search(
        r"tensor '[a-z_.]+weight' is \[\d+, 96\], --hf-checkpoint .*'s '[a-z_.]+' is \[\d+, 64\]", err
    )
    for target in (released, os.path.dirname(released)):  # --out is replaced: never an input or above one
        with pytest.raises(SystemExit) as e:
            main(["extract", "--hf-checkpoint", released, "--out", target])
        assert e.value.code == 2 and "or holds it, and --out is replaced" in capsys.readouterr().err
    assert os.path.exists(os.path.join(released, "config.json"))
    # a text model without its untied lm_head: the original's would stay untrained
    text = tmp_path / "text"
    assert main(["extract", "--hf-checkpoint", released, "--out", str(text)]) == 0
    shards = [n for n in os.listdir(text) if n.startswith("model-")]
    for name in shards:
        tensors = {k: v for k, v in load_file(str(text / name)).items() if k != "lm_head.weight"}
        save_file(tensors, str(text / name))
    capsys.readouterr()
    err = refused(["merge", "--text", str(text), "--hf-checkpoint", released, "--out", str(out)])
    assert "lacks 1 tensor(s) of the text model, e.g. 'lm_head.weight'" in err
