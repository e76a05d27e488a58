"""The Megatron actor trains Qwen3-MoE (megatron-core's MoE layer and all-to-all dispatcher, on
CPU over gloo) like one FSDP rank trains the Hugging Face model: the experts on one rank, split
over two expert-parallel ranks, and PP 2 x EP 2. Same log-probs, step metrics and exported weights
within the dense tests' bounds (tests/test_megatron_actor.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install megatron-core)")

from slime.config.train import MegatronConfig
from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import base_config, make_batch
from tests.test_megatron_actor import ROLLOUTS, assert_trains_like, exported


def moe_run(rank, world_size, init_method, model, backend, tp=1, pp=1, ep=1, mbs=2, save_dir=None):
    from slime.backends import make_train_actor

    cfg = base_config(model, micro_batch_size=mbs)
    if backend == "megatron":
        cfg = dataclasses.replace(cfg, backend="megatron", megatron=MegatronConfig(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep))  # fmt: skip
    actor = make_train_actor(cfg, rank, world_size, init_method)
    info = actor.init()
    batch = make_batch(0)
    result = {"info": info, "lp": actor.compute_log_probs(batch), "outputs": []}
    for r in range(ROLLOUTS):
        result["outputs"].append(actor.train(r, make_batch(r)))
        if r == 0:
            result["probe"] = actor.compute_log_probs(make_batch(7))
            if save_dir:
                actor.save(r, save_dir)
    result["weights"] = exported(actor)
    actor.close()
    return result


def resumed(rank, world_size, init_method, model, ep, load):
    from slime.backends import make_train_actor

    cfg = dataclasses.replace(base_config(model, micro_batch_size=2), backend="megatron", load=load,
                              megatron=MegatronConfig(expert_model_parallel_size=ep))  # fmt: skip
    actor = make_train_actor(cfg, rank, world_size, init_method)
    info = actor.init()
    outputs = [actor.train(r, make_batch(r)) for r in range(info["resumed_rollout_id"] + 1, ROLLOUTS)]
    result = {"info": info, "outputs": outputs, "weights": exported(actor)}
    actor.close()
    return result


@pytest.fixture(scope="module")
def fsdp_moe(tiny_moe):
    return run_ranks(1, moe_run, tiny_moe, "fsdp")[0]


@pytest.mark.parametrize(
    "pp, ep, world, mbs",
    [(1, 2, 2, 2), (1, 1, 1, 2), (2, 2, 4, 2), (1, 2, 4, 1)],
    # ep2-dp4: four data-parallel ranks, each expert on two of them (expert data parallelism 2)
    ids=["ep2", "ep1", "pp2xep2", "ep2-dp4"],
)
def test_megatron_moe_trains_like_one_fsdp_rank(fsdp_moe, tiny_moe, pp, ep, world, mbs):
    ranks = run_ranks(world, moe_run, tiny_moe, "megatron", 1, pp, ep, mbs)
    assert [r["info"]["dp"] for r in ranks] == [world // pp] * world
    assert_trains_like(fsdp_moe, ranks)


def test_ep2_checkpoint_resumes_bit_for_bit(tiny_moe, tmp_path):
    """Each expert data-parallel group writes one file (Megatron-LM's mp_rank_TT_EEE names); a
    resumed run continues with the same steps and ends with the same weights, bit for bit."""
    import os

    save_dir = str(tmp_path / "ckpt")
    ranks = run_ranks(2, moe_run, tiny_moe, "megatron", 1, 1, 2, 2, save_dir)
    assert sorted(os.listdir(os.path.join(save_dir, "iter_0000000"))) == ["mp_rank_00_000", "mp_rank_00_001"]
    again = run_ranks(2, resumed, tiny_moe, 2, save_dir)
    assert again[0]["info"]["resumed_rollout_id"] == 0
    assert [s for o in again[0]["outputs"] for s in o.steps] == [
        s for o in ranks[0]["outputs"][1:] for s in o.steps
    ]
    for name, value in ranks[0]["weights"].items():
        assert torch.equal(again[0]["weights"][name], value), name


def test_moe_options_the_megatron_actor_does_not_build_are_refused_by_name(tiny_moe, tiny_model):
    from transformers import AutoConfig

    from slime.backends.megatron.actor import check_moe
    from slime.backends.megatron.convert import Layout
    from slime.config.train import MoEOptions

    moe_layout = Layout.from_hf_config(AutoConfig.from_pretrained(tiny_moe))
    dense_layout = Layout.from_hf_config(AutoConfig.from_pretrained(tiny_model))
    m = MegatronConfig()
    assert (
        check_moe(m, moe_layout, MoEOptions(moe_router_dtype="fp64")) is None
    )  # megatron-core's moe_router_dtype
    assert "--moe-aux-loss-coeff" in check_moe(m, moe_layout, MoEOptions(moe_aux_loss_coeff=0.01))
    assert "--use-rollout-routing-replay" in check_moe(
        m, moe_layout, MoEOptions(use_rollout_routing_replay=True)
    )
    assert "--moe-router-dtype needs a mixture-of-experts model" in check_moe(
        m, dense_layout, MoEOptions(moe_router_dtype="fp32")
    )
    assert "--sequence-parallel" in check_moe(MegatronConfig(tensor_model_parallel_size=2), moe_layout)
