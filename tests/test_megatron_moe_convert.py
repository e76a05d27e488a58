"""HF <-> megatron-core conversion of a mixture-of-experts model (Qwen3-MoE: router, experts as
megatron-core's SequentialMLP or TEGroupedMLP names them, a dense layer among MoE ones), and its
resharding over EP and ETP / TP ranks. Pure tensor code: bit-exact or it fails."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from slime.backends.megatron.convert import (
    ConversionError,
    Layout,
    expert_names,
    hf_to_megatron,
    megatron_to_hf,
)
from slime.backends.megatron.rank_files import shard, unshard
from slime.backends.megatron.sharding import (
    hf_to_megatron_shard,
    merge_experts,
    rank_shard,
    split_experts,
    split_pp,
)
from slime.utils.hf_experts import checkpoint_tensors

MOE = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    num_hidden_layers=4,
    mlp_only_layers=[1],
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    vocab_size=101,
    max_position_embeddings=64,
    norm_topk_prob=True,
    tie_word_embeddings=False,
)


def tiny_moe(**over) -> tuple[Layout, dict[str, torch.Tensor]]:
    """A Qwen3-MoE state dict in checkpoint names (one tensor per expert), every tensor distinct."""
    torch.manual_seed(0)
    config = Qwen3MoeConfig(**{**MOE, **over})
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    state = {k: v.clone() for k, v in checkpoint_tensors("qwen3_moe", model.state_dict().items())}
    return Layout.from_hf_config(config), state


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_layout_reads_the_experts_and_which_layers_are_moe():
    layout, hf = tiny_moe()
    assert (layout.num_experts, layout.moe_ffn_hidden_size, layout.moe_layers) == (4, 32, (1, 0, 1, 1))
    assert (
        "model.layers.0.mlp.experts.3.down_proj.weight" in hf and "model.layers.1.mlp.gate_proj.weight" in hf
    )


@pytest.mark.parametrize("grouped", [False, True])
def test_hf_megatron_hf_round_trip_is_bitwise(grouped):
    layout, hf = tiny_moe()
    layout = Layout(**{**layout.__dict__, "grouped_experts": grouped})
    mc = hf_to_megatron(hf, layout)
    fc1, fc2 = expert_names(layout, 2, 3)
    assert fc1.endswith("linear_fc1.weight3" if grouped else "local_experts.3.linear_fc1.weight")
    assert torch.equal(mc["decoder.layers.2.mlp.router.weight"], hf["model.layers.2.mlp.gate.weight"])
    e = "model.layers.2.mlp.experts.3."
    assert torch.equal(mc[fc1], torch.cat([hf[e + "gate_proj.weight"], hf[e + "up_proj.weight"]]))
    assert torch.equal(mc[fc2], hf[e + "down_proj.weight"])
    assert "decoder.layers.1.mlp.linear_fc1.weight" in mc and "decoder.layers.1.mlp.router.weight" not in mc
    assert same(megatron_to_hf(mc, layout), hf)


@pytest.mark.parametrize("fold_norms", [False, True])
def test_a_moe_layer_keeps_its_own_norm_under_transformer_engines_spec(fold_norms):
    layout, hf = tiny_moe()
    layout = Layout(**{**layout.__dict__, "fold_norms": fold_norms})
    mc = hf_to_megatron(hf, layout)
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in mc  # MoE layer: both specs
    dense_norm = "mlp.linear_fc1.layer_norm_weight" if fold_norms else "pre_mlp_layernorm.weight"
    assert f"decoder.layers.1.{dense_norm}" in mc
    assert same(megatron_to_hf(mc, layout), hf)


@pytest.mark.parametrize("ep, etp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)])
def test_ep_and_etp_split_and_merge_bit_for_bit(ep, etp):
    layout, hf = tiny_moe()
    mc = hf_to_megatron(hf, layout)
    parts = split_experts(mc, layout, ep, etp)
    assert set(parts) == {(r, t) for r in range(ep) for t in range(etp)}
    per = layout.num_experts // ep
    fc1, fc2 = expert_names(layout, 0, per - 1)  # the last local expert of every rank
    for (r, t), part in parts.items():
        assert len([n for n in part if n.startswith("decoder.layers.0.")]) == 2 * per
        whole1, whole2 = (
            mc[expert_names(layout, 0, r * per + per - 1)[0]],
            mc[expert_names(layout, 0, r * per + per - 1)[1]],
        )
        gate, up = whole1.chunk(2)
        assert torch.equal(part[fc1], torch.cat([gate.chunk(etp)[t], up.chunk(etp)[t]]))
        assert torch.equal(part[fc2], whole2.chunk(etp, dim=1)[t])
        assert not any("router" in n or "linear_qkv" in n for n in part)
    merged = merge_experts(parts, layout)
    assert same(merged, {k: v for k, v in mc.items() if "experts" in k})


@pytest.mark.parametrize(
    "tp, pp, ep, etp", [(1, 1, 2, 1), (2, 1, 2, 1), (2, 2, 2, 2), (1, 2, 4, 1), (2, 1, 1, 2)]
)
def test_one_ranks_shard_reads_only_its_experts_and_round_trips(tp, pp, ep, etp):
    layout, hf = tiny_moe()
    mc = hf_to_megatron(hf, layout, tp)
    stages = split_pp(mc, layout, pp)
    read: set[str] = set()

    class Recording(dict):
        def __getitem__(self, name):
            read.add(name)
            return super().__getitem__(name)

    ranks = {}
    for s in range(pp):
        for t in range(tp):
            for r in range(ep):
                for x in range(etp):
                    read.clear()
                    got = hf_to_megatron_shard(Recording(hf), layout, tp, pp, t, s, ep, etp, r, x)
                    want = rank_shard(stages[s], layout, tp, t, ep, etp, r, x)
                    assert same(got, want), (t, s, r, x)
                    experts_read = {int(n.split(".")[5]) for n in read if ".mlp.experts." in n}
                    per = layout.num_experts // ep
                    assert experts_read == set(range(r * per, (r + 1) * per))
                    ranks[(t, s, r, x)] = got
    # back: dense parts by (tp, stage), experts by (ep, etp) within each stage
    by_stage = shard(mc, layout, tp, pp)
    for s in range(pp):
        experts = merge_experts({(r, x): ranks[(0, s, r, x)] for r in range(ep) for x in range(etp)}, layout)
        for t in range(tp):
            dense = {k: v for k, v in ranks[(t, s, 0, 0)].items() if "mlp.experts." not in k}
            by_stage[(t, s)] = {**dense, **experts}
    assert same(megatron_to_hf(unshard(by_stage, layout), layout), hf)


def test_bad_expert_layouts_are_named():
    layout, _ = tiny_moe()
    with pytest.raises(ConversionError, match="EP 3 must divide the 4 experts"):
        layout.check_parallel(1, 1, ep=3)
    with pytest.raises(ConversionError, match="ETP 3 must divide the experts' MLP size 32"):
        layout.check_parallel(1, 1, etp=3)
    dense = Layout(**{**layout.__dict__, "num_experts": 0, "moe_ffn_hidden_size": 0, "moe_layers": ()})
    with pytest.raises(ConversionError, match="expert parallelism needs a mixture-of-experts model"):
        dense.check_parallel(1, 1, ep=2)
    _, hf = tiny_moe()
    del hf["model.layers.2.mlp.experts.1.up_proj.weight"]
    with pytest.raises(ConversionError, match=r"model\.layers\.2\.mlp\.experts\.1\.up_proj\.weight"):
        hf_to_megatron(hf, layout)


def test_shared_experts_are_read_only_where_the_modeling_has_them():
    from transformers import Qwen2MoeConfig

    qwen2_moe = Qwen2MoeConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_experts=4,
        shared_expert_intermediate_size=32,
        moe_intermediate_size=16,
        vocab_size=50,
    )
    with pytest.raises(
        ConversionError, match="'qwen2_moe': not among the families the Megatron backend builds"
    ):
        Layout.from_hf_config(qwen2_moe)
    variant = Qwen3MoeConfig(**MOE)
    variant.shared_expert_intermediate_size = 32  # transformers' Qwen3-MoE builds no shared expert for it
    layout = Layout.from_hf_config(variant)
    assert layout.shared_ffn_hidden_size == 0 and not layout.shared_expert_gate


@pytest.mark.parametrize(
    "tp, pp, ep, etp", [(2, 1, 2, 2), (2, 2, 2, 1), (1, 1, 4, 1), (2, 1, 1, 2), (1, 2, 2, 1)]
)
def test_checkpoint_files_hold_each_ranks_shard_and_join_back(tp, pp, ep, etp):
    """One file per (TP rank, stage, EP rank): each holds what that rank's actor loads (its ETP
    rank is its TP rank modulo ETP), and the files join back to the whole model bit for bit."""
    from slime.backends.megatron.rank_files import Parallel, merge_ranks, split_ranks

    layout, hf = tiny_moe()
    mc = hf_to_megatron(hf, layout, tp)
    par = Parallel(tp, pp, ep, etp)
    parts = split_ranks(mc, layout, par)
    assert sorted(parts) == sorted((t, s, e) for t in range(tp) for s in range(pp) for e in range(ep))
    for (t, s, e), part in parts.items():
        assert same(part, hf_to_megatron_shard(hf, layout, tp, pp, t, s, ep, etp, e, t % etp)), (t, s, e)
    assert same(merge_ranks(parts, layout, par), mc)


def test_a_runs_files_join_back_and_a_missing_expert_shard_is_named():
    """A run writes only its ranks' files (EP carved out of data parallelism: TP 2 x EP 2 on two
    ranks has (TP, EP) ranks (0, 0) and (1, 1)): with ETP 1 they hold every expert once; with ETP 2
    the experts of (EP 0, ETP 1) are in no file, and the error says so."""
    from slime.backends.megatron.rank_files import Parallel, merge_ranks, split_ranks

    layout, hf = tiny_moe()
    mc = hf_to_megatron(hf, layout, 2)
    run = [(0, 0, 0), (1, 0, 1)]
    etp1 = Parallel(2, 1, 2, 1)
    parts = split_ranks(mc, layout, etp1)
    assert same(merge_ranks({k: parts[k] for k in run}, layout, etp1), mc)
    etp2 = Parallel(2, 1, 2, 2)
    parts = split_ranks(mc, layout, etp2)
    with pytest.raises(ConversionError, match="no shard of EP rank 0, ETP rank 1, pipeline stage 0"):
        merge_ranks({k: parts[k] for k in run}, layout, etp2)
    with pytest.raises(ConversionError, match="ETP 2 with TP 1"):
        split_ranks(hf_to_megatron(hf, layout, 1), layout, Parallel(1, 1, 2, 2))
