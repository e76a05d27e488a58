"""The Megatron backend on a released Qwen3.5 checkpoint (the vision-language model): it builds
the language model, read from `model.language_model.*`, and pushes and writes it back under
those names with the vision tower as loaded. It computes and trains exactly as on the text model `python -m
slime.tools.text_model extract` writes, and its --save-hf is that tool's `merge` of the text
model's, bit for bit."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from tests.conftest import make_model
from tests.dist_helpers import run_ranks

SIZE = ["--hidden-size", "64", "--num-heads", "2", "--num-kv-heads", "1", "--num-layers", "2"]


def _run(rank, world_size, init_method, model, save_hf, ep):
    from slime.backends import make_train_actor
    from slime.config.train import MegatronConfig
    from tests.test_fsdp_actor import base_config, make_batch
    from tests.test_megatron_actor import exported

    torch.set_num_threads(1)
    cfg = dataclasses.replace(
        base_config(model, micro_batch_size=2),
        backend="megatron",
        megatron=MegatronConfig(expert_model_parallel_size=ep),
    )
    actor = make_train_actor(cfg, rank, world_size, init_method)
    actor.init()
    out = {"lp": actor.compute_log_probs(make_batch(0)), "steps": actor.train(0, make_batch(0)).steps}
    out["weights"] = exported(actor)
    out["shapes"] = actor.backend.weight_shapes()
    actor.save_hf(save_hf)
    actor.close()
    return out


@pytest.mark.parametrize(
    "arch, ep",
    [("qwen3_5_vl", 1), pytest.param("qwen3_5_moe_vl", 2, marks=pytest.mark.slow)],
    ids=["qwen3_5", "qwen3_5_moe-ep2"],
)
def test_a_released_qwen3_5_trains_as_its_text_model(tmp_path, arch, ep):
    from safetensors.torch import load_file

    from slime.tools.text_model import extract, merge
    from slime.utils.model_families import language_name

    released = make_model(str(tmp_path / "released"), 0, "--arch", arch, *SIZE)
    extract(released, str(tmp_path / "text"))
    vl = run_ranks(ep, _run, released, str(tmp_path / "vl_saved"), ep)[0]
    text = run_ranks(ep, _run, str(tmp_path / "text"), str(tmp_path / "text_saved"), ep)[0]
    assert vl["lp"] == text["lp"] and vl["steps"] == text["steps"]
    # pushed under the released checkpoint's names, with the vision tower as loaded (the engine
    # serves the whole model; --check-weight-sync checks every tensor it holds)
    stored = load_file(f"{released}/model.safetensors")
    assert vl["weights"].keys() == stored.keys()
    assert all(torch.equal(vl["weights"][language_name(n)], t) for n, t in text["weights"].items())
    vision = [n for n in stored if n.startswith("model.visual.")]
    assert vision and all(torch.equal(vl["weights"][n], stored[n]) for n in vision)
    assert vl["shapes"] == {n: tuple(t.shape) for n, t in stored.items()}
    # --save-hf: the released checkpoint again, the text model's training merged in
    merge(str(tmp_path / "text_saved"), released, str(tmp_path / "merged"))
    saved, merged = load_file(tmp_path / "vl_saved" / "model.safetensors"), {}
    for name in sorted(os.listdir(tmp_path / "merged")):
        if name.endswith(".safetensors"):
            merged.update(load_file(tmp_path / "merged" / name))
    assert saved.keys() == merged.keys() == stored.keys()
    assert all(torch.equal(saved[n], merged[n]) for n in saved)
    assert (tmp_path / "vl_saved" / "config.json").read_text() == (
        tmp_path / "merged" / "config.json"
    ).read_text()
    from transformers import AutoModelForImageTextToText

    assert AutoModelForImageTextToText.from_pretrained(tmp_path / "vl_saved").config.model_type == (
        "qwen3_5" if arch == "qwen3_5_vl" else "qwen3_5_moe"
    )


def test_megatron_takes_a_released_qwen3_5_for_text_prompts_only(tmp_path, capsys):
    """A text job with the released checkpoint parses on Megatron; prompts with images and a
    critic from it are refused by name (exit 2): the Megatron backend has no vision tower."""
    from slime.ray.cli import parse_args
    from tests.test_flag_surface import base, error

    released = make_model(str(tmp_path / "released"), 0, "--arch", "qwen3_5_vl", *SIZE)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    megatron = ["--train-backend", "megatron"]
    assert parse_args(base(released, str(prompts), *megatron)).cluster.train_backend == "megatron"
    images = ["--apply-chat-template", "--multimodal-keys", '{"image": "images"}']
    err = error(capsys, base(released, str(prompts), *megatron, *images))
    assert "--multimodal-keys with --train-backend megatron: the Megatron backend trains a vision" in err
    err = error(capsys, base(released, str(prompts), *megatron, "--train-vision-model"))
    assert "--train-vision-model configure the FSDP backend; with --train-backend megatron drop them" in err
    err = error(capsys, base(released, str(prompts), *megatron, "--advantage-estimator", "ppo"))
    assert "the Megatron backend's critic is not built from (use --train-backend fsdp" in err


def test_the_conversion_tools_take_a_released_qwen3_5_and_give_it_back_bitwise(tmp_path):
    """convert_hf_to_megatron reads the released checkpoint's language model; convert_megatron_to_hf
    with it as --hf-checkpoint writes the released checkpoint again, every tensor bit for bit."""
    from safetensors.torch import load_file

    from tests.test_megatron_tools import tool

    released = make_model(str(tmp_path / "released"), 0, "--arch", "qwen3_5_vl", *SIZE)
    r = tool("convert_hf_to_megatron", "--hf-checkpoint", released, "--save-dir", str(tmp_path / "mcore"))
    assert r.returncode == 0, r.stderr
    r = tool(
        "convert_megatron_to_hf",
        "--load-dir",
        str(tmp_path / "mcore"),
        "--hf-checkpoint",
        released,
        "--save-dir",
        str(tmp_path / "back"),
    )
    assert r.returncode == 0, r.stderr
    back, stored = (
        load_file(tmp_path / "back" / "model.safetensors"),
        load_file(f"{released}/model.safetensors"),
    )
    assert back.keys() == stored.keys() and all(torch.equal(back[n], stored[n]) for n in stored)
    assert (tmp_path / "back" / "config.json").read_text() == open(f"{released}/config.json").read()
