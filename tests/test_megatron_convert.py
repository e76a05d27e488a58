"""HF <-> megatron-core conversion and TP/PP resharding (slime.backends.megatron.convert), on tiny
Qwen2 (QKV bias), Qwen3 (QK norm) and Llama (untied head) configs with grouped-query attention.
Pure tensor code: no megatron-core needed."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from slime.backends.megatron.convert import (
    ConversionError,
    Layout,
    hf_to_megatron,
    megatron_to_hf,
    padded_vocab_size,
)
from slime.backends.megatron.rank_files import shard, unshard
from slime.backends.megatron.sharding import (
    hf_to_megatron_shard,
    merge_pp,
    merge_tp,
    repad_vocab,
    split_pp,
    split_tp,
)

COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=5,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=101,
    max_position_embeddings=64,
)


def tiny(kind: str, **over) -> tuple[Layout, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    common = {**COMMON, **over}
    if kind == "qwen2":
        config = Qwen2Config(**common, tie_word_embeddings=True)
    elif kind == "qwen3":
        config = Qwen3Config(**common, head_dim=16, tie_word_embeddings=True)
    else:
        config = LlamaConfig(**common, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():  # norms start at 1 and biases at 0: make every tensor distinct
            p.copy_(torch.randn_like(p))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return Layout.from_hf_config(config), state


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_hf_megatron_hf_round_trip_is_bitwise(kind):
    layout, hf = tiny(kind)
    assert layout.qkv_bias == (kind == "qwen2") and layout.qk_norm == (kind == "qwen3")
    mc = hf_to_megatron(hf, layout)
    assert ("output_layer.weight" in mc) == (kind == "llama")
    assert same(megatron_to_hf(mc, layout), hf)


def test_fused_qkv_is_megatrons_grouped_layout():
    layout, hf = tiny("qwen2")
    qkv = hf_to_megatron(hf, layout)["decoder.layers.3.self_attention.linear_qkv.weight"]
    d, per = layout.head_dim, layout.num_heads // layout.num_query_groups  # 8, 2 query heads per group
    q, k, v = (hf[f"model.layers.3.self_attn.{n}_proj.weight"] for n in "qkv")
    for g in range(layout.num_query_groups):  # group g: its 2 query heads, then its key, then its value
        rows = qkv[g * (per + 2) * d : (g + 1) * (per + 2) * d]
        assert torch.equal(rows[: per * d], q[g * per * d : (g + 1) * per * d])
        assert torch.equal(rows[per * d : (per + 1) * d], k[g * d : (g + 1) * d])
        assert torch.equal(rows[(per + 1) * d :], v[g * d : (g + 1) * d])


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
def test_tp_1_2_4_1_and_pp_1_2_1_reshard_bit_for_bit(kind):
    layout, hf = tiny(kind)
    mc = hf_to_megatron(hf, layout, tp=1)
    # TP 1 -> 2 -> 4 -> 1, re-padding the vocabulary for each TP on the way (what the tool does).
    two = split_tp(repad_vocab(mc, layout, 2), layout, 2)
    four = split_tp(repad_vocab(merge_tp(two, layout), layout, 4), layout, 4)
    assert (
        len(four) == 4
        and four[3]["embedding.word_embeddings.weight"].shape[0] == layout.padded_vocab_size(4) // 4
    )
    assert same(repad_vocab(merge_tp(four, layout), layout, 1), mc)
    layout4, hf4 = tiny(kind, num_hidden_layers=4)
    mc4 = hf_to_megatron(hf4, layout4)
    assert same(merge_pp(split_pp(mc4, layout4, 2), layout4), mc4)
    stages = split_pp(mc4, layout4, 2)
    assert sorted(k for k in stages[1] if ".layers." in k)[0].startswith("decoder.layers.0.")  # renumbered
    assert "embedding.word_embeddings.weight" in stages[0] and "decoder.final_layernorm.weight" in stages[1]
    assert ("output_layer.weight" in stages[1]) and ("output_layer.weight" not in stages[0])  # tied: a copy
    for tp, pp in [(1, 1), (2, 1), (4, 1), (2, 5), (4, 5), (1, 5)]:
        parts = shard(repad_vocab(mc, layout, tp), layout, tp, pp)
        assert len(parts) == tp * pp
        assert same(megatron_to_hf(unshard(parts, layout), layout), hf)


def test_a_tp_shard_holds_whole_query_groups_and_its_gate_and_up_halves():
    layout, hf = tiny("qwen3")
    mc = hf_to_megatron(hf, layout, tp=2)
    r0, r1 = split_tp(mc, layout, 2)
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert r0[name].shape[0] == (layout.num_heads + 2 * layout.num_query_groups) * layout.head_dim // 2
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    ffn = layout.ffn_hidden_size
    gate, up = hf["model.layers.0.mlp.gate_proj.weight"], hf["model.layers.0.mlp.up_proj.weight"]
    assert torch.equal(r1[fc1], torch.cat([gate[ffn // 2 :], up[ffn // 2 :]]))
    assert torch.equal(
        r0["decoder.layers.0.self_attention.linear_proj.weight"],
        hf["model.layers.0.self_attn.o_proj.weight"][:, : layout.num_heads * layout.head_dim // 2],
    )
    assert torch.equal(
        r0["decoder.layers.0.self_attention.q_layernorm.weight"],
        r1["decoder.layers.0.self_attention.q_layernorm.weight"],
    )


@pytest.mark.parametrize("divisor", [1, 64, 128])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_padded_vocabulary_shapes(tp, divisor):
    for vocab in (101, 151_936, 128_256, 32_000):
        padded = padded_vocab_size(vocab, divisor, tp)
        assert padded >= vocab and padded % (divisor * tp) == 0 and padded - vocab < divisor * tp
    layout, hf = tiny("llama", num_key_value_heads=8)  # TP 8 needs 8 query groups
    layout = Layout(**{**layout.__dict__, "make_vocab_size_divisible_by": divisor})
    mc = hf_to_megatron(hf, layout, tp=tp)
    emb = mc["embedding.word_embeddings.weight"]
    assert emb.shape == (padded_vocab_size(101, divisor, tp), 64)
    assert torch.count_nonzero(emb[101:]) == 0 and torch.count_nonzero(mc["output_layer.weight"][101:]) == 0
    shards = split_tp(mc, layout, tp)
    assert {s["embedding.word_embeddings.weight"].shape[0] for s in shards} == {emb.shape[0] // tp}


def test_changing_tp_never_meets_a_vocabulary_size_mismatch():
    """ChatLearn's FAQ: VocabParallelEmbedding size mismatch after a TP change. Re-padding for the
    new TP makes every shard the size megatron-core builds for it."""
    layout, hf = tiny("qwen2", num_key_value_heads=8)
    layout = Layout(**{**layout.__dict__, "make_vocab_size_divisible_by": 8})
    mc2 = hf_to_megatron(hf, layout, tp=2)  # 101 -> 112 rows (multiple of 16)
    with pytest.raises(ConversionError, match=r"112 vocabulary rows, but TP 8 .* needs 128 \(16 per rank\)"):
        split_tp(mc2, layout, 8)  # 14 rows per rank would not load into megatron-core's 16: refused, named
    shards = split_tp(repad_vocab(mc2, layout, 8), layout, 8)
    assert shards[0]["embedding.word_embeddings.weight"].shape[0] == padded_vocab_size(101, 8, 8) // 8


def test_bad_inputs_are_named():
    layout, hf = tiny("qwen3")
    with pytest.raises(ConversionError, match="TP 3 must divide"):
        split_tp(hf_to_megatron(hf, layout), layout, 3)
    broken = dict(hf)
    broken["model.layers.1.self_attn.k_proj.weight"] = broken["model.layers.1.self_attn.k_proj.weight"][:-1]
    with pytest.raises(ConversionError, match=r"model.layers.1.self_attn.k_proj.weight: shape \(63, 64\)"):
        hf_to_megatron(broken, layout)
    with pytest.raises(ConversionError, match=r"no tensor 'model\.norm\.weight'"):
        hf_to_megatron({k: v for k, v in hf.items() if k != "model.norm.weight"}, layout)
    with pytest.raises(ConversionError, match="PP 2 must divide the model's 5 layers"):
        split_pp(hf_to_megatron(hf, layout), layout, 2)


def test_rope_base_is_read_and_scaled_rope_refused():
    """transformers 5 keeps the rotary base in rope_parameters (there is no config.rope_theta): a
    Qwen3 with base 1e6 must not be built with megatron-core's default 10000."""
    from slime.backends.megatron.convert import rope_theta

    assert rope_theta(Qwen3Config(**COMMON, head_dim=16, rope_theta=1e6)) == 1e6
    assert rope_theta(Qwen2Config(**COMMON)) == 10000.0
    scaled = LlamaConfig(**COMMON, rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(ConversionError, match="rope_type 'linear'"):
        Layout.from_hf_config(scaled)


class Reads(dict):
    """A state dict that records which tensors were read."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.read: set[str] = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 5), (4, 5)])
def test_one_ranks_shard_equals_the_full_conversion_and_reads_only_its_stage(kind, tp, pp):
    """What a train rank loads (hf_to_megatron_shard) is bitwise its part of the full conversion,
    and it reads no tensor of another stage's layers."""
    layout, hf = tiny(kind)
    parts = shard(hf_to_megatron(hf, layout, tp), layout, tp, pp)
    for (r, s), expected in parts.items():
        source = Reads(hf)
        assert same(hf_to_megatron_shard(source, layout, tp, pp, r, s), expected), (r, s)
        layers = {int(n.split(".")[2]) for n in source.read if n.startswith("model.layers.")}
        assert layers == set(range(s * layout.num_layers // pp, (s + 1) * layout.num_layers // pp))
        assert ("model.norm.weight" in source.read) == (s == pp - 1)


def test_uneven_pipeline_stages_follow_megatron_lms_rule():
    """--decoder-first/last-pipeline-num-layers: those stages hold what they say, the others split
    the rest evenly; a split that does not fit is named with the flags."""
    import dataclasses

    layout, hf = tiny("qwen3", num_hidden_layers=7)

    def sizes(pp, first=None, last=None):
        return [
            len(r)
            for r in dataclasses.replace(layout, first_stage_layers=first, last_stage_layers=last).stages(pp)
        ]

    assert sizes(1, 3) == [7] and sizes(3, 1, 2) == [1, 4, 2] and sizes(3, 1) == [1, 3, 3]
    assert sizes(4, None, 1) == [2, 2, 2, 1] and sizes(2, 5, 2) == [5, 2]
    with pytest.raises(ConversionError, match="PP 2 must divide the model's 7 layers"):
        layout.stages(2)
    with pytest.raises(
        ConversionError,
        match=r"first/last-pipeline-num-layers 2/None does not split .* 5 layers are left for 2",
    ):
        sizes(3, 2)
    with pytest.raises(ConversionError, match="the two stages hold 6"):
        sizes(2, 3, 3)
    # The conversion and one rank's shard follow the stages: 2 + 5 layers, bitwise both ways.
    uneven = dataclasses.replace(layout, first_stage_layers=2)
    mc = hf_to_megatron(hf, uneven)
    stages = split_pp(mc, uneven, 2)
    assert {int(k.split(".")[2]) for k in stages[0] if ".layers." in k} == {0, 1}
    assert {int(k.split(".")[2]) for k in stages[1] if ".layers." in k} == set(range(5))
    assert same(merge_pp(stages, uneven), mc)
    parts = shard(mc, uneven, 1, 2)
    for (r, s), expected in parts.items():
        source = Reads(hf)
        assert same(hf_to_megatron_shard(source, uneven, 1, 2, r, s), expected)
        layers = {int(n.split(".")[2]) for n in source.read if n.startswith("model.layers.")}
        assert layers == ({0, 1} if s == 0 else set(range(2, 7)))
    assert same(megatron_to_hf(unshard(parts, uneven), uneven), hf)
