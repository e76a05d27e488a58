"""Context parallelism in the Megatron actor (slime.backends.megatron.context_parallel): each
sequence split over CP ranks in megatron-core's load-balanced chunks, torch's attention over the
all-gathered keys and values, log-probs gathered before the loss. CP ranks train like one FSDP
rank (metrics, log-probs and weights), packed and padded, with TP and PP too."""

from __future__ import annotations

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.test_megatron_actor import (  # noqa: F401 - fsdp is a fixture
    ROLLOUTS,
    assert_trains_like,
    config,
    exported,
    fsdp,
    train_run,
)


def test_chunks_are_megatron_cores_load_balanced_halves():
    from slime.backends.megatron.context_parallel import chunk_positions, local_order

    assert chunk_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    # two sequences of 4 and 8 (padded bounds 0, 4, 12): each split on its own
    assert local_order([0, 4, 12], 2, 1).tolist() == [1, 2, 6, 7, 8, 9]
    every = torch.cat([local_order([0, 4, 12], 2, r) for r in range(2)])
    assert sorted(every.tolist()) == list(range(12))


def test_the_cp_view_holds_each_samples_tokens_once_and_their_next_tokens():
    from slime.backends.megatron.context_parallel import cp_view
    from slime.backends.micro_batch import make_micro_batch

    tokens = [[5, 6, 7, 8, 9], [10, 11, 12]]
    for packed in (True, False):
        mb = make_micro_batch([0, 1], tokens, [2, 1], None, torch.device("cpu"), packed)
        views = [cp_view(mb, 2, r, None) for r in range(2)]
        ids = sorted(t for v in views for t, real in zip(v.ids[0].tolist(), v.real[0].tolist()) if real)
        assert ids == sorted(tokens[0] + tokens[1])
        # sample 0 (padded to 8) comes first in the global row; its last real token's next is padding
        where = views[0].where
        assert int(where[0, 4]) == 4 and int(where[0, 0]) == 0
        assert int(where[0 if packed else 1, 5 if packed else 0]) == 8  # sample 1 starts after 8 slots
        targets = {int(p): int(t) for v in views for p, t in zip(v.position_ids[0][:4], v.targets[:4])}
        assert targets[0] == 6 and targets[3] == 9


@pytest.mark.parametrize(
    "padded", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["packed", "padded"]
)
def test_two_cp_ranks_train_like_one_fsdp_rank(fsdp, tiny_model, padded):
    ranks = run_ranks(2, train_run, tiny_model, 1, 1, "megatron", None, False, False, padded, -1, None, 2)
    assert_trains_like(fsdp, ranks)


@pytest.mark.slow
@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)], ids=["tp2xcp2", "pp2xcp2"])
def test_cp_with_tp_or_pp_trains_like_one_fsdp_rank(fsdp, tiny_model, tp, pp):
    ranks = run_ranks(4, train_run, tiny_model, tp, pp, "megatron", None, False, False, False, -1, None, 2)
    assert_trains_like(fsdp, ranks)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_cp_trains_multi_latent_attention_and_experts_like_fsdp(tmp_path, tiny_moe, arch):
    """DeepSeek-V3 (multi-latent attention, sigmoid routing with the expert bias) and Qwen3-MoE,
    CP 2 x EP 2 on two ranks."""
    from tests.conftest import make_model
    from tests.test_megatron_moe_actor import moe_run

    model = (
        tiny_moe
        if arch == "qwen3_moe"
        else make_model(str(tmp_path / arch), 0, "--arch", arch, "--hidden-size", "64", "--num-layers", "3")
    )
    fsdp_run = run_ranks(1, moe_run, model, "fsdp")[0]
    ranks = run_ranks(2, moe_run, model, "megatron", 1, 1, 2, 2, None, None, False, False, 2)
    assert_trains_like(fsdp_run, ranks)


def test_cp_flags_are_accepted_and_what_is_not_built_is_refused(tiny_model, tiny_moe, tmp_path, capsys):
    from slime.ray.cli import parse_args
    from tests.test_flag_surface import base, error

    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    cfg = parse_args(
        base(
            tiny_model,
            str(data),
            "--train-backend",
            "megatron",
            "--context-parallel-size",
            "2",
            "--actor-num-gpus-per-node",
            "2",
            "--allgather-cp",
        )
    )
    assert cfg.train.megatron.context_parallel_size == 2
    cases = [
        (
            tiny_model,
            ["--train-backend", "fsdp", "--context-parallel-size", "2"],
            "configure --train-backend megatron",
        ),
        (
            tiny_model,
            ["--train-backend", "megatron", "--context-parallel-size", "2", "--actor-num-gpus-per-node", "3"],
            "does not divide the 3 train ranks",
        ),
        (
            tiny_moe,
            [
                "--train-backend",
                "megatron",
                "--context-parallel-size",
                "2",
                "--actor-num-gpus-per-node",
                "2",
                "--moe-aux-loss-coeff",
                "0.01",
            ],
            "--moe-aux-loss-coeff with --context-parallel-size 2 is not built",
        ),
    ]
    # megatron-core's own router dtype needs no hook: accepted with CP
    parse_args(
        base(
            tiny_moe,
            str(data),
            "--train-backend",
            "megatron",
            "--context-parallel-size",
            "2",
            "--actor-num-gpus-per-node",
            "2",
            "--moe-router-dtype",
            "fp32",
        )
    )
    for model, extra, message in cases:
        assert message in error(capsys, base(model, str(data), *extra)), extra


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, cp, dynamic, recompute, chunk",
    [(4, 2, False, False, -1), (4, 4, False, False, -1), (2, 2, True, False, -1), (2, 2, False, True, 3)],
    ids=["dp2xcp2", "cp4", "cp2-dynamic-batches", "cp2-recompute-log-prob-chunks"],
)
def test_more_cp_layouts_train_like_one_fsdp_rank(fsdp, tiny_model, world, cp, dynamic, recompute, chunk):
    """Data and context parallelism together, four CP ranks (chunks r and 2 x CP - 1 - r), token-budget
    micro-batches (a GPU's budget times CP, as slime counts it), full recompute with chunked log-probs."""
    ranks = run_ranks(
        world, train_run, tiny_model, 1, 1, "megatron", None, dynamic, recompute, False, chunk, None, cp
    )
    assert_trains_like(fsdp, ranks)


def _critic_run(rank, world_size, init_method, model, cp):
    import dataclasses

    from slime.backends import make_train_actor
    from tests.test_critic import fake_returns
    from tests.test_fsdp_actor import make_batch
    from tests.test_megatron_critic import _everyone

    cfg = dataclasses.replace(config(model), check_precision=True)
    cfg = dataclasses.replace(cfg, megatron=dataclasses.replace(cfg.megatron, context_parallel_size=cp))
    critic = make_train_actor(cfg, rank, world_size, init_method, critic=True)
    info = critic.init()
    mine = critic.compute_values(make_batch(0))
    result = {"info": info, "answered": bool(mine), "values": _everyone(mine), "outputs": []}
    for r in range(2):
        batch = make_batch(r)
        old = _everyone(critic.compute_values(batch))
        result["outputs"].append(critic.train_values(r, batch, old, fake_returns(batch, r)))
    result["after"] = _everyone(critic.compute_values(make_batch(0)))
    critic.close()
    return result


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4], ids=["cp2", "dp2xcp2"])
def test_the_critic_with_cp_trains_like_one_fsdp_rank(tiny_model, world):
    from tests.test_critic import critic_run
    from tests.test_megatron_critic import assert_trains_like as critic_like

    reference = run_ranks(1, critic_run, tiny_model)[0]
    ranks = run_ranks(world, _critic_run, tiny_model, 2)
    assert [r["answered"] for r in ranks] == [True, False] * (world // 2)  # CP rank 0 of each replica
    critic_like(reference, ranks)


def _resume_run(rank, world_size, init_method, model, cp, save_dir, load):
    import dataclasses

    from slime.backends import make_train_actor
    from tests.test_fsdp_actor import make_batch

    cfg = dataclasses.replace(config(model), load=load)
    cfg = dataclasses.replace(cfg, megatron=dataclasses.replace(cfg.megatron, context_parallel_size=cp))
    actor = make_train_actor(cfg, rank, world_size, init_method)
    info = actor.init()
    first = 0 if info["resumed_rollout_id"] is None else info["resumed_rollout_id"] + 1
    for r in range(first, ROLLOUTS):
        actor.train(r, make_batch(r))
        if save_dir and r == 0:
            actor.save(r, save_dir, extra={"next_prompt": 3})
    result = {"info": info, "weights": exported(actor)}
    actor.close()
    return result


@pytest.mark.slow
def test_a_cp_checkpoint_resumes_bit_for_bit_and_loads_without_cp(tiny_model, tmp_path):
    save = str(tmp_path / "ckpt")
    full = run_ranks(2, _resume_run, tiny_model, 2, save, None)
    resumed = run_ranks(2, _resume_run, tiny_model, 2, None, save)
    assert resumed[0]["info"]["resumed_rollout_id"] == 0
    for name, value in full[0]["weights"].items():
        assert torch.equal(resumed[0]["weights"][name], value), name
    one = run_ranks(1, _resume_run, tiny_model, 1, None, save)[0]  # CP ranks hold the same weights
    for name, value in full[0]["weights"].items():
        torch.testing.assert_close(one["weights"][name], value, rtol=0, atol=2e-5, msg=name)


@pytest.mark.slow
def test_the_expert_bias_moves_with_cp_as_with_fsdp(tmp_path):
    """--moe-router-bias-update-rate at CP 2 x EP 2 (the routers count each rank's real tokens)."""
    from safetensors.torch import load_file

    from tests.conftest import make_model
    from tests.test_megatron_moe_actor import moe_run

    path = make_model(
        str(tmp_path / "ds"), 0, "--arch", "deepseek_v3", "--hidden-size", "64", "--num-layers", "3"
    )
    moe = {"moe_router_bias_update_rate": 1e-3}
    reference = run_ranks(1, moe_run, path, "fsdp", 1, 1, 1, 2, None, moe)[0]
    ranks = run_ranks(2, moe_run, path, "megatron", 1, 1, 2, 2, None, moe, False, True, 2)  # padded rows too
    assert_trains_like(reference, ranks)
    hf = load_file(f"{path}/model.safetensors")
    assert any(
        (reference["weights"][n] - hf[n]).abs().max() > 1e-4 for n in hf if "e_score_correction_bias" in n
    )
