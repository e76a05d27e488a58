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


def routed_batch(seed: int, r3: bool = False, shape: tuple[int, int, int] = (2, 4, 2)):
    """make_batch(seed); with `r3`, engine routing tables too: for each token and each of the
    model's layers, k distinct experts of its E (`shape`: layers, E, k; the tiny MoE's two
    layers, four experts, two per token) drawn at random (not the routing the model would choose,
    so replaying them changes the log-probs)."""
    batch = make_batch(seed)
    if not r3:
        return batch
    layers, experts, k = shape
    g = torch.Generator().manual_seed(100 + seed)
    tables = [
        torch.rand(len(t) - 1, layers, experts, generator=g).argsort(-1)[..., :k].int() for t in batch.tokens
    ]
    return dataclasses.replace(batch, rollout_routed_experts=tables)


def routing_shape(model: str) -> tuple[int, int, int]:
    """The checkpoint's (layers, experts, experts per token)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model)
    return c.num_hidden_layers, getattr(c, "num_experts", None) or c.n_routed_experts, c.num_experts_per_tok


def moe_run(
    rank,
    world_size,
    init_method,
    model,
    backend,
    tp=1,
    pp=1,
    ep=1,
    mbs=2,
    save_dir=None,
    moe=None,
    recompute=False,
    padded=False,
    cp=1,
):
    from slime.backends import make_train_actor
    from slime.config.train import ModelOptions, MoEOptions

    cfg = base_config(model, micro_batch_size=mbs)
    if moe:
        cfg = dataclasses.replace(cfg, moe=MoEOptions(**moe))
    if recompute:  # megatron-core's full recompute: every layer runs again in backward
        cfg = dataclasses.replace(cfg, model=ModelOptions(recompute_granularity="full"))
    if padded:  # one right-padded row per sample: padding tokens reach the routers
        cfg = dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, padded_micro_batches=True))
    if backend == "megatron":
        cfg = dataclasses.replace(
            cfg,
            backend="megatron",
            megatron=MegatronConfig(
                tensor_model_parallel_size=tp,
                pipeline_model_parallel_size=pp,
                expert_model_parallel_size=ep,
                context_parallel_size=cp,
            ),
        )
    actor = make_train_actor(cfg, rank, world_size, init_method)
    info = actor.init()
    r3 = bool(moe and moe.get("use_rollout_routing_replay"))
    shape = routing_shape(model) if r3 else (0, 0, 0)
    result = {"info": info, "lp": actor.compute_log_probs(routed_batch(0, r3, shape)), "outputs": []}
    for r in range(ROLLOUTS):
        result["outputs"].append(actor.train(r, routed_batch(r, r3, shape)))
        if r == 0:
            result["probe"] = actor.compute_log_probs(routed_batch(7, r3, shape))
            if save_dir:
                actor.save(r, save_dir)
                result["saved"] = exported(actor)
    result["weights"] = exported(actor)
    actor.close()
    return result


def resumed(rank, world_size, init_method, model, ep, load):
    from slime.backends import make_train_actor

    cfg = dataclasses.replace(
        base_config(model, micro_batch_size=2),
        backend="megatron",
        load=load,
        megatron=MegatronConfig(expert_model_parallel_size=ep),
    )
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
    # The conversion tool gathers the experts from both EP files: the weights the actor had.
    from safetensors.torch import load_file

    from tests.test_megatron_tools import tool

    hf_dir = tmp_path / "hf"
    r = tool(
        "convert_megatron_to_hf",
        "--load-dir",
        save_dir,
        "--hf-checkpoint",
        tiny_moe,
        "--save-dir",
        str(hf_dir),
    )
    assert r.returncode == 0, r.stderr
    converted = load_file(hf_dir / "model.safetensors")
    assert converted.keys() == ranks[0]["saved"].keys()
    for name, value in ranks[0]["saved"].items():
        assert torch.equal(converted[name], value), name


R2_AUX = {"use_routing_replay": True, "moe_aux_loss_coeff": 0.01}
R3 = {"use_rollout_routing_replay": True}


@pytest.fixture(scope="module")
def fsdp_r2_aux(tiny_moe):
    """One FSDP rank with R2 + the aux loss (tests/test_fsdp_moe.py checks both against hand
    computations on Hugging Face's model). The aux loss is not additive over samples (it balances
    each micro-batch as a whole): with one sample per micro-batch every layout of the step's
    samples has the same micro-batches."""
    return run_ranks(1, moe_run, tiny_moe, "fsdp", 1, 1, 1, 1, None, R2_AUX)[0]


@pytest.fixture(scope="module")
def fsdp_r3(tiny_moe):
    """One FSDP rank with R3 (replaying tables unlike the model's own routing)."""
    return run_ranks(1, moe_run, tiny_moe, "fsdp", 1, 1, 1, 1, None, R3)[0]


@pytest.mark.parametrize(
    "options, pp, ep, world, recompute",
    [
        # ~8 s; EP 2 with R2 and the aux loss also runs in the PP 2 x EP 2 case below
        pytest.param("r2_aux", 1, 2, 2, False, marks=pytest.mark.slow),
        ("r2_aux", 2, 2, 4, True),
        # ~10 s; R2 above replays through the same hooks, queues and token order
        pytest.param("r3", 2, 2, 4, True, marks=pytest.mark.slow),
    ],
    ids=["r2-aux-ep2", "r2-aux-pp2xep2-recompute", "r3-pp2xep2-recompute"],
)
def test_megatron_routing_replay_and_aux_loss_train_like_fsdp(
    request, tiny_moe, options, pp, ep, world, recompute
):
    """Routing replay (R2: the log-prob pass's routing; R3: the engine's, here tables that differ
    from the model's own choice) and --moe-aux-loss-coeff give the FSDP rank's log-probs, step
    metrics (moe_aux_loss among them) and weights, also with PP 2 and full recompute, where each
    checkpointed layer routes again in backward after other micro-batches' forwards."""
    moe = R2_AUX if options == "r2_aux" else R3
    # One sample per micro-batch: two micro-batches per replica and step, so under PP the second's
    # forward comes before the first's backward (and its recompute).
    ranks = run_ranks(world, moe_run, tiny_moe, "megatron", 1, pp, ep, 1, None, moe, recompute)
    expected = request.getfixturevalue("fsdp_r2_aux" if options == "r2_aux" else "fsdp_r3")
    assert_trains_like(expected, ranks)
    if options == "r2_aux":
        assert all(s["moe_aux_loss"] > 0 for o in ranks[0]["outputs"] for s in o.steps)


def test_fsdp_two_ranks_with_r2_and_the_aux_loss_train_like_one(fsdp_r2_aux, tiny_moe):
    """The FSDP reference above holds for N ranks too: two FSDP ranks with R2 and the aux loss
    (one sample per micro-batch) give one rank's log-probs, metrics and weights."""
    ranks = run_ranks(2, moe_run, tiny_moe, "fsdp", 1, 1, 1, 1, None, R2_AUX)
    assert_trains_like(fsdp_r2_aux, ranks, only_rank0_exports=False)


@pytest.mark.slow  # with the R3 case above
def test_replayed_routing_changes_what_the_megatron_actor_computes(fsdp_moe, fsdp_r3):
    """The R3 tables are not the model's own routing: the log-probs differ from plain ones (so
    the test above could fail when replay did nothing)."""
    plain, r3 = fsdp_moe["lp"], fsdp_r3["lp"]
    assert max(abs(a - b) for i in plain for a, b in zip(plain[i], r3[i])) > 1e-3


def test_moe_options_checked_at_start_up(tiny_moe, tiny_model):
    from transformers import AutoConfig

    from slime.backends.megatron.convert import Layout
    from slime.backends.megatron.settings import check_moe
    from slime.config.train import MoEOptions

    moe_layout = Layout.from_hf_config(AutoConfig.from_pretrained(tiny_moe))
    dense_layout = Layout.from_hf_config(AutoConfig.from_pretrained(tiny_model))
    m = MegatronConfig()
    assert (
        check_moe(m, moe_layout, MoEOptions(moe_router_dtype="fp64")) is None
    )  # megatron-core's moe_router_dtype
    for options in (R2_AUX, R3):
        assert check_moe(m, moe_layout, MoEOptions(**options)) is None
    assert "--moe-router-dtype needs a mixture-of-experts model" in check_moe(
        m, dense_layout, MoEOptions(moe_router_dtype="fp32")
    )
    assert "--sequence-parallel" in check_moe(MegatronConfig(tensor_model_parallel_size=2), moe_layout)
