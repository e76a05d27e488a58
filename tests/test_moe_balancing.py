"""The load-balancing losses of mixture-of-experts training: megatron-core's `aux_loss` and its
per-sequence `seq_aux_loss` (`--moe-router-load-balancing-type`), on softmax routers (Qwen3-MoE)
and on the sigmoid routers of DeepSeek-V3 and GLM-4.5+ (their routing left as the model computes
it, their scores read), in both train backends."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_model
from tests.dist_helpers import run_ranks


def test_the_losses_are_megatron_cores():
    """slime.backends.routing's losses against megatron-core's own functions: the sigmoid scores
    and top-k its aux losses read, and seq_aux_loss as megatron-core's router computes it for
    `bsz` sequences of one length (the [sequence, batch] rows reshaped to batch x experts)."""
    from megatron.core.transformer.moe.moe_utils import (
        compute_routing_scores_for_aux_loss,
        switch_load_balancing_loss_func,
    )

    from slime.backends.routing import load_balancing_loss, sequence_balancing_loss, sigmoid_aux_routing

    torch.manual_seed(0)
    seq_length, bsz, experts, top_k = 7, 3, 8, 2
    logits = torch.randn(seq_length * bsz, experts)  # sequence-major: token t of sequence b at t * bsz + b
    want_map, want_scores = compute_routing_scores_for_aux_loss(logits, top_k, "sigmoid")
    scores, routed = sigmoid_aux_routing(logits, top_k)
    torch.testing.assert_close(scores, want_scores)
    assert torch.equal(routed.bool(), want_map)
    # megatron-core's _apply_seq_aux_loss, unfused
    rows_scores, rows_map = want_scores.reshape(seq_length, -1), want_map.reshape(seq_length, -1)
    want = (
        switch_load_balancing_loss_func(rows_scores, rows_map.sum(dim=0), seq_length, top_k, experts, 1.0)
        / bsz
    )
    seq = torch.arange(bsz).repeat(seq_length)
    got = sequence_balancing_loss(scores, routed, seq, bsz, top_k) / bsz
    torch.testing.assert_close(got, want)
    # one sequence: the micro-batch's aux_loss
    one = torch.zeros(seq_length * bsz, dtype=torch.long)
    torch.testing.assert_close(
        sequence_balancing_loss(scores, routed, one, 1, top_k), load_balancing_loss(scores, routed, top_k)
    )
    # unequal lengths: each sequence's own
    seq = torch.tensor([0] * 5 + [1] * 16)
    parts = [load_balancing_loss(scores[seq == s], routed[seq == s], top_k) for s in (0, 1)]
    torch.testing.assert_close(sequence_balancing_loss(scores, routed, seq, 2, top_k), sum(parts))


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("balancing")
    return {
        arch: make_model(str(root / arch), 0, "--arch", arch, "--hidden-size", "64", "--num-layers", "3")
        for arch in ("deepseek_v3", "glm4_moe_lite")
    }


def _fsdp_seq_aux_by_hand(path, options):
    """The FSDP actor's run and a hand computation of its first step's moe_aux_loss from
    transformers' router logits: each sample's seq_aux_loss, averaged over the step's samples (the
    batch's first four: global batch 4)."""
    from transformers import AutoModelForCausalLM

    from slime.backends.routing import sequence_balancing_loss, sigmoid_aux_routing
    from tests.test_fsdp_actor import make_batch
    from tests.test_megatron_moe_actor import moe_run

    result = run_ranks(1, moe_run, path, "fsdp", 1, 1, 1, 2, None, options)[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = make_batch(0)
    logits_per_layer: dict[int, list[torch.Tensor]] = {}
    hooks = [
        layer.mlp.gate.register_forward_hook(
            lambda m, a, out, li=li: logits_per_layer.setdefault(li, []).append(out[0])
        )
        for li, layer in enumerate(model.model.layers)
        if hasattr(layer.mlp, "gate")
    ]
    with torch.no_grad():
        for tokens in batch.tokens[:4]:
            model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    top_k, total = model.config.num_experts_per_tok, 0.0
    for per_sample in logits_per_layer.values():
        for logits in per_sample:  # each sample a sequence of its own
            scores, routed = sigmoid_aux_routing(logits, top_k)
            seq = torch.zeros(logits.shape[0], dtype=torch.long)
            total += float(sequence_balancing_loss(scores, routed, seq, 1, top_k)) / 4
    return result, total


def test_seq_aux_loss_of_a_sigmoid_router_is_each_samples_own(moe_models):
    """DeepSeek-V3's routers (a bias, groups) with seq_aux_loss: the step's moe_aux_loss is the
    mean over the step's samples of each one's megatron-core seq_aux_loss, computed by hand from
    transformers' router logits, and the loss moves the weights (the router gets its gradient)."""
    from tests.test_megatron_moe_actor import moe_run

    options = {"moe_aux_loss_coeff": 0.01, "moe_router_load_balancing_type": "seq_aux_loss"}
    result, expected = _fsdp_seq_aux_by_hand(moe_models["deepseek_v3"], options)
    assert result["outputs"][0].steps[0]["moe_aux_loss"] == pytest.approx(expected, rel=1e-5)
    plain = run_ranks(1, moe_run, moe_models["deepseek_v3"], "fsdp", 1, 1, 1, 2)[0]
    moved = [k for k in plain["weights"] if not torch.equal(plain["weights"][k], result["weights"][k])]
    assert any(k.endswith("mlp.gate.weight") for k in moved), moved
    # the routing itself is the model's: the first log-prob pass (before any step) is untouched
    assert result["lp"] == plain["lp"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "arch, kind, ep, world, mbs",
    [
        ("deepseek_v3", "seq_aux_loss", 1, 1, 2),
        ("glm4_moe_lite", "aux_loss", 1, 1, 2),
        ("deepseek_v3", "seq_aux_loss", 2, 2, 2),  # additive over samples: any split of the step
        ("glm4_moe_lite", "aux_loss", 2, 2, 1),
    ],  # one sample per micro-batch: the same micro-batches
)
def test_the_megatron_actor_balances_sigmoid_routers_like_fsdp(moe_models, arch, kind, ep, world, mbs):
    from tests.test_megatron_actor import assert_trains_like
    from tests.test_megatron_moe_actor import moe_run

    options = {"moe_aux_loss_coeff": 0.01, "moe_router_load_balancing_type": kind}
    fsdp = run_ranks(1, moe_run, moe_models[arch], "fsdp", 1, 1, 1, mbs, None, options)[0]
    ranks = run_ranks(world, moe_run, moe_models[arch], "megatron", 1, 1, ep, mbs, None, options)
    assert_trains_like(fsdp, ranks)
    assert all(s["moe_aux_loss"] > 0 for o in ranks[0]["outputs"] for s in o.steps)


def test_balancing_flags_with_the_sigmoid_families(moe_models, tmp_path):
    """seq_aux_loss with a coefficient parses for DeepSeek-V3 with either backend, and so do routing
    replay and the float64 router."""
    from slime.ray.cli import parse_args
    from tests.test_flag_surface import base

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    path = moe_models["deepseek_v3"]
    for backend in ("fsdp", "megatron"):
        cfg = parse_args(
            base(
                path,
                str(prompts),
                "--train-backend",
                backend,
                "--moe-aux-loss-coeff",
                "0.01",
                "--moe-router-load-balancing-type",
                "seq_aux_loss",
            )
        )
        assert cfg.train.moe.per_sequence and cfg.train.moe.aux_loss_coeff == 0.01
        flags = ("--use-rollout-routing-replay", "--moe-router-dtype", "fp64")
        cfg = parse_args(base(path, str(prompts), "--train-backend", backend, *flags))
        assert cfg.train.moe.use_rollout_routing_replay and cfg.train.moe.moe_router_dtype == "fp64"


def _mtp_router_step(rank, world_size, init_method, path, coeff):
    """One training step of the Megatron actor training DeepSeek-V3's MTP module, with the aux
    loss at `coeff` (no clipping): the routers' weights after it."""
    import dataclasses

    from slime.backends import make_train_actor
    from slime.config.train import MoEOptions
    from tests.test_fsdp_actor import make_batch
    from tests.test_megatron_actor import config

    cfg = config(path)
    cfg = dataclasses.replace(
        cfg,
        megatron=dataclasses.replace(cfg.megatron, mtp_num_layers=1, enable_mtp_training=True),
        moe=MoEOptions(moe_aux_loss_coeff=coeff),
        optimizer=dataclasses.replace(cfg.optimizer, clip_grad=0.0),
    )
    actor = make_train_actor(cfg, rank, world_size, init_method)
    actor.init()
    steps = actor.train(0, make_batch(0, num_samples=4)).steps  # (global batch 4: one optimizer step)
    assert len(steps) == 1
    routers = {
        k: v.clone() for k, v in actor.backend.model_state().items() if k.endswith("mlp.router.weight")
    }
    actor.close()
    return routers


@pytest.mark.slow
def test_the_aux_loss_reaches_the_mtp_modules_router(tmp_path):
    """As megatron-core's aux loss reaches every router: with MTP training, the MTP module's MoE
    router is balanced too (its weights move otherwise than without the loss)."""
    path = make_model(
        str(tmp_path / "mtp"),
        0,
        "--arch",
        "deepseek_v3",
        "--hidden-size",
        "64",
        "--num-layers",
        "2",
        "--mtp-layers",
        "1",
    )
    plain = run_ranks(1, _mtp_router_step, path, 0.0)[0]
    balanced = run_ranks(1, _mtp_router_step, path, 1.0)[0]
    mtp = "mtp.layers.0.transformer_layer.mlp.router.weight"
    assert mtp in plain and "decoder.layers.1.mlp.router.weight" in plain
    for name in (mtp, "decoder.layers.1.mlp.router.weight"):
        assert not torch.equal(plain[name], balanced[name]), name


def test_an_unlisted_families_aux_loss_is_refused(tmp_path, capsys):
    """A mixture-of-experts family the registry does not list (dots1: sigmoid scores, a bias,
    groups) routes otherwise than any hook: its aux loss is refused by name, not run through
    softmax routing."""
    import transformers

    from tests.test_flag_surface import base, error

    path = tmp_path / "dots1"
    transformers.Dots1Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        n_routed_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        intermediate_size=128,
        vocab_size=101,
    ).save_pretrained(path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    err = error(capsys, base(str(path), str(prompts), "--moe-aux-loss-coeff", "0.01"))
    assert (
        "--moe-aux-loss-coeff: routing replay and the router's aux loss are not built for model_type 'dots1'"
        in err
    )
