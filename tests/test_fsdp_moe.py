"""The FSDP actor with a mixture-of-experts model (tiny Qwen3-MoE, 4 experts, top-2).

transformers fuses each layer's experts into two parameters while checkpoints hold one tensor
per expert (slime.utils.hf_experts): every rank reads only its own experts from the files, two
ranks train like one, and whatever leaves the actor (weight export, --save-hf) carries the
checkpoint's per-expert names.
"""

from __future__ import annotations

import glob

import pytest
import torch

from slime.backends.fsdp import model_init
from slime.utils import hf_experts
from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import NUM_ROLLOUTS, assert_steps_match, run_sharded, run_single


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in glob.glob(f"{path}/*.safetensors"):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def hf_moe(tiny_moe):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_reads_its_experts_from_per_expert_files(tiny_moe, hf_moe, world_size, monkeypatch):
    """No whole-checkpoint fallback: the fused expert rows come from the per-expert tensors
    (3 ranks over 4 experts: 2, 2 and none)."""

    def no_fallback(*args):
        raise AssertionError("read_local_shards fell back to from_pretrained")

    monkeypatch.setattr(model_init, "_shards_via_from_pretrained", no_fallback)
    meta = model_init.build_meta_model(hf_moe.config, "sdpa")
    for rank in range(world_size):
        shards = model_init.read_local_shards(meta, tiny_moe, rank, world_size)
        for name, param in hf_moe.named_parameters():
            start, end = model_init.shard_rows(param.shape[0], rank, world_size)
            assert torch.equal(shards[name], param.detach()[start:end]), name
    assert "model.layers.0.mlp.experts.gate_up_proj" in shards


def test_checkpoint_names_split_fused_experts_and_back(hf_moe, tiny_moe):
    params = dict(hf_moe.named_parameters())
    on_disk = checkpoint_tensors(tiny_moe)
    named = dict(hf_experts.checkpoint_tensors("qwen3_moe", params.items()))
    assert named.keys() == on_disk.keys()
    for name, value in on_disk.items():
        assert torch.equal(named[name], value), name
    shapes = hf_experts.checkpoint_shapes("qwen3_moe", {n: tuple(p.shape) for n, p in params.items()})
    assert shapes == {n: tuple(t.shape) for n, t in on_disk.items()}
    # A dense family passes through untouched, even with a parameter of the same name.
    assert dict(hf_experts.checkpoint_tensors("gpt_oss", params.items())).keys() == params.keys()


@pytest.fixture(scope="module")
def runs(tiny_moe, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp-moe")
    save_dir, hf_dir = str(tmp / "ckpt"), str(tmp / "hf")
    single = run_ranks(1, run_single, tiny_moe)[0]
    sharded = run_ranks(2, run_sharded, tiny_moe, save_dir, hf_dir)
    return dict(single=single, sharded=sharded, hf_dir=hf_dir)


def test_two_ranks_train_moe_like_one(runs, hf_moe):
    single, (rank0, rank1) = runs["single"], runs["sharded"]
    for name, value in hf_moe.named_parameters():
        assert torch.equal(single["initial"][name], value.detach()), name
    steps_1 = [s for out in single["outputs"] for s in out.steps]
    assert len(steps_1) == 2 * NUM_ROLLOUTS
    for rank_result in (rank0, rank1):
        assert_steps_match(steps_1, [s for out in rank_result["outputs"] for s in out.steps])
    experts = "model.layers.1.mlp.experts.gate_up_proj"
    for name, value in single["final"].items():
        assert (value - single["initial"][name]).abs().max() > 0, f"{name} never changed"
        torch.testing.assert_close(rank0["final"][name], value, rtol=0, atol=1e-5)
        assert torch.equal(rank0["final"][name], rank1["final"][name])
    # Every expert was routed to and trained.
    moved = (single["final"][experts] - single["initial"][experts]).flatten(1).abs().amax(1)
    assert bool((moved > 0).all()), moved
    assert single["actor_lp"] == single["ref_lp"]
    assert single["outputs"][0].steps[0]["kl_loss"] == 0.0


def test_export_and_save_hf_use_per_expert_names(runs, tiny_moe):
    from transformers import AutoModelForCausalLM

    rank0 = runs["sharded"][0]
    final = dict(hf_experts.checkpoint_tensors("qwen3_moe", rank0["final"].items()))
    expected_names = sorted(checkpoint_tensors(tiny_moe))
    exported = {n: t for b in rank0["buckets"] for n, t in b}
    assert sorted(exported) == expected_names
    for name, tensor in exported.items():
        assert torch.equal(tensor, final[name]), name
    saved = checkpoint_tensors(runs["hf_dir"])
    assert sorted(saved) == expected_names
    loaded = dict(
        AutoModelForCausalLM.from_pretrained(runs["hf_dir"], dtype=torch.float32).named_parameters()
    )
    for name, value in rank0["final"].items():
        assert torch.equal(loaded[name].detach(), value), name
