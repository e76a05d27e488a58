"""slime.backends.routing (what both backends' router hooks compute) and the Megatron hooks'
token order, by hand."""

from __future__ import annotations

import pytest
import torch

from slime.backends.routing import choose, load_balancing_loss
from tests.dist_helpers import run_ranks


def test_choose_replays_where_told_and_keeps_the_router_elsewhere():
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1], [0.3, 0.2, 0.4, 0.1]])
    replay = torch.tensor([[0, 1], [-1, -1], [3, -1]])
    weights, experts = choose(probs, 2, replay, renormalize=False)
    assert experts.tolist() == [[0, 1], [0, 1], [3, 0]]  # row 2: own top-2 (2, 0), slot 0 replayed
    assert torch.allclose(weights, torch.tensor([[0.1, 0.2], [0.4, 0.3], [0.1, 0.3]]))
    weights, _ = choose(probs, 2, replay, renormalize=True)
    assert torch.allclose(weights[0], torch.tensor([1 / 3, 2 / 3]))
    own_w, own_e = choose(probs, 2, None, renormalize=True)
    assert own_e[1].tolist() == [0, 1] and torch.allclose(own_w[1], torch.tensor([4 / 7, 3 / 7]))


def test_load_balancing_loss_is_megatron_cores_aux_loss():
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(5, 4, generator=g).softmax(-1)
    experts = torch.tensor([[0, 1], [0, 2], [0, 1], [3, 1], [0, 2]])
    routed = torch.zeros(5, 4).scatter_(1, experts, 1.0)
    by_hand = 0.0
    for e in range(4):
        tokens_to_e = sum(int(e in row) for row in experts.tolist())
        by_hand += float(probs[:, e].sum()) * tokens_to_e
    by_hand *= 4 / (2 * 5 * 5)  # E / (k T^2)
    assert abs(float(load_balancing_loss(probs, routed, 2)) - by_hand) < 1e-6
    # Balanced routing with uniform probabilities gives 1 (the loss's minimum).
    uniform = torch.full((4, 4), 0.25)
    balanced = torch.zeros(4, 4).scatter_(1, torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]), 1.0)
    assert abs(float(load_balancing_loss(uniform, balanced, 2)) - 1.0) < 1e-6


def _split_tokens(rank, world_size, init_method, probs, routed):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    part = probs.shape[0] // world_size
    mine = probs[rank * part : (rank + 1) * part].clone().requires_grad_()
    loss = load_balancing_loss(mine, routed[rank * part : (rank + 1) * part], 2, dist.group.WORLD)
    loss.backward()
    assert mine.grad is not None
    out = {"loss": float(loss), "grad": mine.grad.clone()}
    dist.destroy_process_group()
    return out


def test_load_balancing_loss_over_a_sequence_parallel_group_is_the_whole_sequences():
    """Tokens split over two ranks (megatron-core's sequence parallelism): each rank gets the whole
    sequence's loss, and the gradient of its own tokens' probabilities."""
    g = torch.Generator().manual_seed(1)
    probs = torch.rand(6, 4, generator=g).softmax(-1)
    routed = torch.zeros(6, 4).scatter_(1, torch.rand(6, 4, generator=g).argsort(-1)[:, :2], 1.0)
    whole = probs.clone().requires_grad_()
    loss = load_balancing_loss(whole, routed, 2)
    loss.backward()
    loss = loss.detach()
    assert whole.grad is not None
    ranks = run_ranks(2, _split_tokens, probs, routed)
    for rank, result in enumerate(ranks):
        assert abs(result["loss"] - loss.item()) < 1e-6
        torch.testing.assert_close(result["grad"], whole.grad[rank * 3 : (rank + 1) * 3], rtol=0, atol=1e-7)


def test_router_order_is_sequence_major_and_sliced_per_sequence_parallel_rank():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    from slime.backends.megatron.moe import from_router_order, router_order

    ids = torch.arange(8)  # two rows of four tokens, row-major: row 0 = 0..3, row 1 = 4..7
    assert router_order(ids, 2).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert router_order(ids, 2, sp_rank=1, sp_size=2).tolist() == [2, 6, 3, 7]
    assert from_router_order(router_order(ids, 2), 2).tolist() == ids.tolist()
    table = torch.arange(24).reshape(8, 3)  # per-token rows travel whole
    assert torch.equal(from_router_order(router_order(table, 2), 2), table)


def _gather_slices(rank, world_size, init_method):
    import torch.distributed as dist

    from slime.backends.megatron.moe import from_router_order, router_order

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    ids = torch.arange(12)
    back = from_router_order(router_order(ids, 3, rank, world_size), 3, dist.group.WORLD, world_size)
    dist.destroy_process_group()
    return back.tolist()


def test_router_order_slices_gather_back_over_the_sequence_parallel_group():
    pytest.importorskip("megatron.core", reason="megatron-core is not installed")
    assert run_ranks(2, _gather_slices) == [list(range(12))] * 2


def test_a_routing_table_is_checked_in_the_moe_layers_a_stage_holds():
    """A table's expert ids are checked in the MoE layers only (a dense layer's entries are
    ignored), and a pipeline stage of dense layers only takes any table of the right shape."""
    from slime.backends.routing import RouterHooks
    from slime.utils.errors import UsageError

    hooks = RouterHooks()
    hooks.num_layers, hooks.top_k, hooks.num_experts, hooks.moe_layers = 2, 2, 4, [1]
    table = torch.tensor([[[-1, -1], [0, 3]]] * 3)
    assert torch.equal(hooks.check_table(table, 3, "t"), table)
    with pytest.raises(UsageError, match=r"t: expert ids outside \[0, 4\) in the MoE layers \[1\]"):
        hooks.check_table(torch.tensor([[[0, 1], [0, 4]]] * 3), 3, "t")
    with pytest.raises(UsageError, match=r"t: shape \(2, 2, 2\), expected \(3, 2, 2\)"):
        hooks.check_table(table[:2], 3, "t")
    hooks.moe_layers = []  # a stage of dense layers only (DeepSeek-V3's first, under PP)
    assert torch.equal(hooks.check_table(table, 3, "t"), table)


def test_group_limited_topk_and_sigmoid_weights_are_deepseek_v3s_router():
    """The float64 router's choice (bias, groups) and the replay weights equal transformers'
    DeepSeek-V3 router on the same scores: 16 experts in 4 groups, 2 groups kept, top-4."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from slime.backends.routing import group_limited_topk, sigmoid_weights

    config = DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2
    )
    config.routed_scaling_factor = 2.5
    router = DeepseekV3TopkRouter(config)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.1)
    logits, weights, experts = router(torch.randn(64, 32, generator=g))
    ours = group_limited_topk(logits.sigmoid(), router.e_score_correction_bias, 4, 4, 2)
    assert torch.equal(ours.sort(-1).values, experts.sort(-1).values)
    # groups matter here: the plain top-4 of the biased scores differs for some tokens
    plain = (logits.sigmoid() + router.e_score_correction_bias).topk(4, dim=-1).indices
    assert not torch.equal(plain.sort(-1).values, experts.sort(-1).values)
    assert torch.equal(sigmoid_weights(logits, experts, True, 2.5), weights)
    assert not torch.allclose(sigmoid_weights(logits, experts, False, 2.5), weights)
