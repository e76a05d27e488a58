"""Hugging Face <-> megatron-core (GPTModel) state dicts, and TP / PP resharding. Pure tensor code:
no megatron-core import, runs on CPU.

Megatron-side names are megatron-core's GPTModel names:

    embedding.word_embeddings.weight                       [padded vocab / TP, hidden]   split dim 0
    decoder.layers.{i}.input_layernorm.weight              local spec (TE spec: linear_qkv.layer_norm_weight)
    decoder.layers.{i}.self_attention.linear_qkv.weight    fused QKV, grouped by query group  split dim 0
    decoder.layers.{i}.self_attention.linear_qkv.bias      (Qwen2)                        split dim 0
    decoder.layers.{i}.self_attention.q_layernorm.weight   (Qwen3: per-head RMSNorm)      replicated
    decoder.layers.{i}.self_attention.k_layernorm.weight
    decoder.layers.{i}.self_attention.linear_proj.weight   [hidden, heads * head_dim / TP] split dim 1
    decoder.layers.{i}.pre_mlp_layernorm.weight            local spec (TE spec: linear_fc1.layer_norm_weight)
    decoder.layers.{i}.mlp.linear_fc1.weight               [gate; up], each TP rank [gate_r; up_r]
    decoder.layers.{i}.mlp.linear_fc2.weight               [hidden, ffn / TP]              split dim 1
    decoder.final_layernorm.weight
    output_layer.weight                                    [padded vocab / TP, hidden] (untied only)

A mixture-of-experts layer (Qwen3-MoE) has, instead of `mlp.linear_fc1/fc2`:

    decoder.layers.{i}.pre_mlp_layernorm.weight            (both specs: the MoE layer has its own norm)
    decoder.layers.{i}.mlp.router.weight                   [experts, hidden]               replicated
    decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight   [gate; up] of expert e
    decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc2.weight   [hidden, moe ffn]
      (megatron-core's SequentialMLP; its TEGroupedMLP names them mlp.experts.linear_fc1.weight{e}
      and mlp.experts.linear_fc2.weight{e}, `Layout.grouped_experts`)

Experts are split over expert-parallel (EP) ranks, E / EP consecutive experts each, numbered
from 0 on every rank, and each expert over expert-tensor-parallel (ETP) ranks as a dense MLP over
TP ranks ([gate_r; up_r] rows of fc1, columns of fc2). The TP split leaves experts whole
(`split_tp`); `split_experts` / `merge_experts` do EP and ETP. The shards of whole checkpoints
(one per file) are slime.backends.megatron.rank_files'.

Fused QKV layout (megatron-core's): for each of the `num_query_groups` (= HF num_key_value_heads)
groups, its `heads / groups` query heads, then its key head, then its value head, each head_dim
rows. The vocabulary is padded to a multiple of `make_vocab_size_divisible_by x TP` with zero rows
(Megatron's rule), which are removed again on the way back. Pipeline stages hold consecutive
layers renumbered from 0 on each stage; the first stage holds the embedding, the last the final
norm and output layer (with tied embeddings the last stage holds `output_layer.weight`, a copy
of the embedding, as megatron-core does when PP > 1).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

State = dict[str, torch.Tensor]


class ConversionError(ValueError):
    """A checkpoint or config that cannot be converted (names what and why)."""


@dataclass(frozen=True)
class Layout:
    """What the conversion needs to know about the model (from an HF config)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    make_vocab_size_divisible_by: int = 128
    fold_norms: bool = False
    """Transformer Engine's layer spec: the input / pre-MLP norms live in linear_qkv / linear_fc1."""
    num_experts: int = 0
    """Routed experts per MoE layer (0: a dense model)."""
    moe_ffn_hidden_size: int = 0
    moe_layers: tuple[int, ...] = ()
    """1 for each mixture-of-experts layer, 0 for a dense one (empty: a dense model)."""
    grouped_experts: bool = False
    """megatron-core's TEGroupedMLP names (mlp.experts.linear_fc1.weight{e}) instead of SequentialMLP's."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(int(x) for x in self.moe_layers))  # a stored list too

    def is_moe(self, layer: int) -> bool:
        return bool(self.num_experts) and bool(self.moe_layers[layer])

    @classmethod
    def from_hf_config(
        cls, config: Any, make_vocab_size_divisible_by: int = 128, fold_norms: bool = False
    ) -> Layout:
        """Qwen2, Qwen3 and Llama configs (dense, SiLU-gated MLP, RMSNorm)."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED:
            raise ConversionError(
                f"model_type {model_type!r} is not supported by the Megatron conversion; supported: {', '.join(SUPPORTED)}"
            )
        rope_theta(config)  # refuses a rope scaling megatron-core's GPTModel is not built with here
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ConversionError(f"hidden_act {config.hidden_act!r}: only SiLU-gated MLPs are converted")
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        moe = _moe_shape(config)
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            num_query_groups=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=SUPPORTED[model_type]["qkv_bias"] or bool(getattr(config, "attention_bias", False)),
            qk_norm=SUPPORTED[model_type]["qk_norm"],
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            fold_norms=fold_norms,
            **moe,
        )

    def padded_vocab_size(self, tp: int) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    def check_parallel(self, tp: int, pp: int, ep: int = 1, etp: int = 1) -> None:
        if tp < 1 or pp < 1:
            raise ConversionError(f"tensor and pipeline parallel sizes must be >= 1, got TP {tp}, PP {pp}")
        if ep < 1 or etp < 1:
            raise ConversionError(f"expert parallel sizes must be >= 1, got EP {ep}, ETP {etp}")
        if ep > 1 and not self.num_experts:  # (ETP: no experts to split, as in Megatron-LM)
            raise ConversionError(
                f"EP {ep}: expert parallelism needs a mixture-of-experts model, and this one is dense: "
                "use --expert-model-parallel-size 1"
            )
        if self.num_experts and self.num_experts % ep:
            raise ConversionError(f"EP {ep} must divide the {self.num_experts} experts of each MoE layer")
        if self.num_experts and self.moe_ffn_hidden_size % etp:
            raise ConversionError(f"ETP {etp} must divide the experts' MLP size {self.moe_ffn_hidden_size}")
        if self.num_query_groups % tp or self.num_heads % tp:
            raise ConversionError(
                f"TP {tp} must divide the attention heads ({self.num_heads}) and the key/value heads "
                f"({self.num_query_groups}): megatron-core splits the fused QKV by query group"
            )
        if self.ffn_hidden_size % tp:
            raise ConversionError(f"TP {tp} must divide the MLP size {self.ffn_hidden_size}")
        if self.num_layers % pp:
            raise ConversionError(
                f"PP {pp} must divide the model's {self.num_layers} layers (megatron-core gives every pipeline "
                "stage the same number of layers)"
            )


def rope_theta(config: Any) -> float:
    """The rotary base of an HF config. Only plain RoPE is supported: scaled variants (llama3,
    yarn, ...) would give megatron-core other positions than the engine, so they are refused."""
    from slime.config.architecture import rope_scaling

    kind, _, theta = rope_scaling(config)
    if kind != "default":
        raise ConversionError(
            f"rope_type {kind!r}: the Megatron backend builds plain RoPE only (the config's rope scaling is not converted)"
        )
    return theta


SUPPORTED = {
    "qwen2": {"qkv_bias": True, "qk_norm": False},
    "qwen3": {"qkv_bias": False, "qk_norm": True},
    "llama": {"qkv_bias": False, "qk_norm": False},
    "qwen3_moe": {"qkv_bias": False, "qk_norm": True},
}


def _moe_shape(config: Any) -> dict[str, Any]:
    """The MoE fields of a Layout (none for a dense config). Shared experts (Qwen2-MoE, GLM,
    DeepSeek) are not converted yet: refused rather than dropped."""
    from slime.config.architecture import hf_moe

    moe = hf_moe(config)
    if not moe["num_experts"]:
        return {}
    if moe["moe_shared_expert_intermediate_size"]:
        raise ConversionError(
            f"model_type {config.model_type!r} has shared experts, which the Megatron conversion does not cover yet"
        )
    if moe["moe_router_topk_scaling_factor"] != 1.0:
        raise ConversionError("a routed scaling factor other than 1 is not converted yet")
    return {
        "num_experts": moe["num_experts"],
        "moe_ffn_hidden_size": moe["moe_ffn_hidden_size"],
        "moe_layers": tuple(moe["moe_layer_freq"]),
    }


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: the vocabulary rounded up to a multiple of divisible_by x TP."""
    if divisible_by < 1:
        raise ConversionError(f"--make-vocab-size-divisible-by must be >= 1, got {divisible_by}")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


# ---- HF <-> Megatron (unsharded) ------------------------------------------------------------


def _norm_names(layout: Layout, i: int) -> tuple[str, str]:
    p = f"decoder.layers.{i}."
    if layout.fold_norms:
        # A MoE layer keeps a norm of its own before the router (no fused linear to fold it into).
        mlp = p + ("pre_mlp_layernorm.weight" if layout.is_moe(i) else "mlp.linear_fc1.layer_norm_weight")
        return p + "self_attention.linear_qkv.layer_norm_weight", mlp
    return p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"


def expert_names(layout: Layout, layer: int, expert: int) -> tuple[str, str]:
    """(fc1, fc2) names of an expert of a MoE layer (`expert` numbered as the state dict does:
    globally when unsharded, from 0 on each EP rank when sharded)."""
    p = f"decoder.layers.{layer}.mlp.experts."
    if layout.grouped_experts:
        return p + f"linear_fc1.weight{expert}", p + f"linear_fc2.weight{expert}"
    return p + f"local_experts.{expert}.linear_fc1.weight", p + f"local_experts.{expert}.linear_fc2.weight"


_EXPERT = re.compile(
    r"^decoder\.layers\.(?P<layer>\d+)\.mlp\.experts\."
    r"(?:local_experts\.(?P<e>\d+)\.(?P<fc>linear_fc[12])\.weight|(?P<gfc>linear_fc[12])\.weight(?P<ge>\d+))$"
)


def parse_expert(name: str) -> tuple[int, int, int] | None:
    """(layer, expert, 0 for linear_fc1 or 1 for linear_fc2) of an expert tensor's name, else None."""
    m = _EXPERT.match(name)
    if not m:
        return None
    fc = m.group("fc") or m.group("gfc")
    expert = m.group("e") if m.group("e") is not None else m.group("ge")
    return int(m.group("layer")), int(expert), 0 if fc == "linear_fc1" else 1


def is_expert(name: str) -> bool:
    return _EXPERT.match(name) is not None


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] > rows:
        raise ConversionError(f"a vocabulary of {t.shape[0]} rows does not fit the padded size {rows}")
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def _take(state: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    if name not in state:
        raise ConversionError(f"the checkpoint has no tensor {name!r}")
    t = state[name]
    if shape is not None and tuple(t.shape) != shape:
        raise ConversionError(f"{name}: shape {tuple(t.shape)}, but the config needs {shape}")
    return t


def hf_to_megatron(hf: Mapping[str, torch.Tensor], layout: Layout, tp: int = 1) -> State:
    """An HF state dict as one unsharded megatron-core state dict (vocabulary padded for `tp`)."""
    out = _embedding(hf, layout, tp)
    for i in range(layout.num_layers):
        out.update(_layer_to_megatron(hf, layout, i))
    out.update(_final(hf, layout, tp))
    return out


def hf_to_megatron_shard(hf: Mapping[str, torch.Tensor], layout: Layout, tp: int, pp: int, tp_rank: int,
                         pp_rank: int, ep: int = 1, etp: int = 1, ep_rank: int = 0,
                         etp_rank: int = 0, lm_head: bool = True) -> State:  # fmt: skip
    """One rank's shard, equal to `rank_shard(shard(hf_to_megatron(hf, layout, tp), layout, tp,
    pp)[(tp_rank, pp_rank)], ...)` with its EP / ETP part of the experts, but reading only the HF
    tensors of its stage (and only its own experts) and converting one layer at a time (with a
    lazy `hf` mapping, slime.backends.megatron.checkpoint.LazyHFState, a rank of a large model
    never holds more than one full layer beside its own shard)."""
    layout.check_parallel(tp, pp, ep, etp)
    layers = stage_layers(layout.num_layers, pp)[pp_rank]
    per = layout.num_experts // ep if layout.num_experts else 0
    mine_experts = range(ep_rank * per, (ep_rank + 1) * per)
    out: State = {}

    def keep(part: State, offset: int = 0) -> None:
        mine = rank_shard(part, layout, tp, tp_rank, ep, etp, ep_rank, etp_rank)
        for name, t in mine.items():
            m = _LAYER.match(name)
            out[f"decoder.layers.{int(m.group(1)) - offset}.{m.group(2)}" if m else name] = t

    if pp_rank == 0:
        keep(_embedding(hf, layout, tp))
    for i in layers:
        keep(_layer_to_megatron(hf, layout, i, mine_experts), layers.start)
    if pp_rank == pp - 1:  # without `lm_head` only the final norm (a critic's head is its own)
        final = _final(hf, layout, tp, lm_head)
        if lm_head and layout.tied_embeddings and pp > 1:  # the last stage's copy of the embedding (split_pp)
            final["output_layer.weight"] = _embedding(hf, layout, tp)["embedding.word_embeddings.weight"]
        keep(final)
    return out


def _embedding(hf: Mapping[str, torch.Tensor], layout: Layout, tp: int) -> State:
    emb = _take(hf, "model.embed_tokens.weight", (layout.vocab_size, layout.hidden_size))
    return {"embedding.word_embeddings.weight": _pad_rows(emb, layout.padded_vocab_size(tp))}


def _final(hf: Mapping[str, torch.Tensor], layout: Layout, tp: int, lm_head: bool = True) -> State:
    out = {"decoder.final_layernorm.weight": _take(hf, "model.norm.weight", (layout.hidden_size,))}
    if lm_head and not layout.tied_embeddings:
        head = _take(hf, "lm_head.weight", (layout.vocab_size, layout.hidden_size))
        out["output_layer.weight"] = _pad_rows(head, layout.padded_vocab_size(tp))
    return out


def _layer_to_megatron(hf: Mapping[str, torch.Tensor], layout: Layout, i: int,
                       experts: range | None = None) -> State:  # fmt: skip
    """Layer i, unsharded; of a MoE layer only `experts` (global ids; None: all)."""
    L, h, d = layout, layout.hidden_size, layout.head_dim
    nq, ng = L.num_heads, L.num_query_groups
    per = nq // ng
    out: State = {}
    src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
    q = _take(hf, src + "self_attn.q_proj.weight", (nq * d, h)).reshape(ng, per * d, h)
    k = _take(hf, src + "self_attn.k_proj.weight", (ng * d, h)).reshape(ng, d, h)
    v = _take(hf, src + "self_attn.v_proj.weight", (ng * d, h)).reshape(ng, d, h)
    out[dst + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], dim=1).reshape(-1, h)
    if L.qkv_bias:
        qb = _take(hf, src + "self_attn.q_proj.bias", (nq * d,)).reshape(ng, per * d)
        kb = _take(hf, src + "self_attn.k_proj.bias", (ng * d,)).reshape(ng, d)
        vb = _take(hf, src + "self_attn.v_proj.bias", (ng * d,)).reshape(ng, d)
        out[dst + "self_attention.linear_qkv.bias"] = torch.cat([qb, kb, vb], dim=1).reshape(-1)
    if L.qk_norm:
        out[dst + "self_attention.q_layernorm.weight"] = _take(hf, src + "self_attn.q_norm.weight", (d,))
        out[dst + "self_attention.k_layernorm.weight"] = _take(hf, src + "self_attn.k_norm.weight", (d,))
    out[dst + "self_attention.linear_proj.weight"] = _take(hf, src + "self_attn.o_proj.weight", (h, nq * d))
    if L.is_moe(i):
        out.update(_experts_to_megatron(hf, L, i, range(L.num_experts) if experts is None else experts))
    else:
        gate = _take(hf, src + "mlp.gate_proj.weight", (L.ffn_hidden_size, h))
        up = _take(hf, src + "mlp.up_proj.weight", (L.ffn_hidden_size, h))
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
        out[dst + "mlp.linear_fc2.weight"] = _take(hf, src + "mlp.down_proj.weight", (h, L.ffn_hidden_size))
    attn_norm, mlp_norm = _norm_names(L, i)
    out[attn_norm] = _take(hf, src + "input_layernorm.weight", (h,))
    out[mlp_norm] = _take(hf, src + "post_attention_layernorm.weight", (h,))
    return out


def _experts_to_megatron(hf: Mapping[str, torch.Tensor], layout: Layout, i: int, experts: range) -> State:
    """The router and `experts` of MoE layer i (Hugging Face's per-expert checkpoint names,
    slime.utils.hf_experts), with global expert ids."""
    h, f = layout.hidden_size, layout.moe_ffn_hidden_size
    src = f"model.layers.{i}.mlp."
    out = {f"decoder.layers.{i}.mlp.router.weight": _take(hf, src + "gate.weight", (layout.num_experts, h))}
    for e in experts:
        fc1, fc2 = expert_names(layout, i, e)
        gate = _take(hf, src + f"experts.{e}.gate_proj.weight", (f, h))
        up = _take(hf, src + f"experts.{e}.up_proj.weight", (f, h))
        out[fc1] = torch.cat([gate, up], dim=0)
        out[fc2] = _take(hf, src + f"experts.{e}.down_proj.weight", (h, f))
    return out


def megatron_to_hf(mc: State, layout: Layout) -> State:
    """The inverse of hf_to_megatron, padding rows dropped (no token id reaches them)."""
    L, h = layout, layout.hidden_size
    out: State = {}
    emb = _take(mc, "embedding.word_embeddings.weight")
    if emb.shape[0] < L.vocab_size or emb.shape[1] != h:
        raise ConversionError(
            f"embedding.word_embeddings.weight: shape {tuple(emb.shape)} for vocabulary {L.vocab_size}"
        )
    out["model.embed_tokens.weight"] = emb[: L.vocab_size].clone()
    for i in range(L.num_layers):
        out.update(layer_to_hf(mc, L, i))
    out["model.norm.weight"] = _take(mc, "decoder.final_layernorm.weight", (h,))
    if not L.tied_embeddings:
        out["lm_head.weight"] = _take(mc, "output_layer.weight")[: L.vocab_size].clone()
    return out


def layer_to_hf(mc: State, layout: Layout, i: int) -> State:
    """Layer i's HF tensors from its megatron-core tensors (`decoder.layers.{i}.*`, unsharded)."""
    L, h, d = layout, layout.hidden_size, layout.head_dim
    nq, ng = L.num_heads, L.num_query_groups
    per = nq // ng
    src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
    out: State = {}
    qkv = _take(mc, src + "self_attention.linear_qkv.weight", ((nq + 2 * ng) * d, h)).reshape(
        ng, (per + 2) * d, h
    )
    out[dst + "self_attn.q_proj.weight"] = qkv[:, : per * d].reshape(nq * d, h).clone()
    out[dst + "self_attn.k_proj.weight"] = qkv[:, per * d : (per + 1) * d].reshape(ng * d, h).clone()
    out[dst + "self_attn.v_proj.weight"] = qkv[:, (per + 1) * d :].reshape(ng * d, h).clone()
    if L.qkv_bias:
        b = _take(mc, src + "self_attention.linear_qkv.bias", ((nq + 2 * ng) * d,)).reshape(ng, (per + 2) * d)
        out[dst + "self_attn.q_proj.bias"] = b[:, : per * d].reshape(-1).clone()
        out[dst + "self_attn.k_proj.bias"] = b[:, per * d : (per + 1) * d].reshape(-1).clone()
        out[dst + "self_attn.v_proj.bias"] = b[:, (per + 1) * d :].reshape(-1).clone()
    if L.qk_norm:
        out[dst + "self_attn.q_norm.weight"] = _take(mc, src + "self_attention.q_layernorm.weight", (d,))
        out[dst + "self_attn.k_norm.weight"] = _take(mc, src + "self_attention.k_layernorm.weight", (d,))
    out[dst + "self_attn.o_proj.weight"] = _take(mc, src + "self_attention.linear_proj.weight", (h, nq * d))
    if L.is_moe(i):
        f = L.moe_ffn_hidden_size
        out[dst + "mlp.gate.weight"] = _take(mc, src + "mlp.router.weight", (L.num_experts, h))
        for e in range(L.num_experts):
            fc1_name, fc2_name = expert_names(L, i, e)
            fc1 = _take(mc, fc1_name, (2 * f, h))
            out[dst + f"mlp.experts.{e}.gate_proj.weight"] = fc1[:f].clone()
            out[dst + f"mlp.experts.{e}.up_proj.weight"] = fc1[f:].clone()
            out[dst + f"mlp.experts.{e}.down_proj.weight"] = _take(mc, fc2_name, (h, f))
    else:
        fc1 = _take(mc, src + "mlp.linear_fc1.weight", (2 * L.ffn_hidden_size, h))
        out[dst + "mlp.gate_proj.weight"] = fc1[: L.ffn_hidden_size].clone()
        out[dst + "mlp.up_proj.weight"] = fc1[L.ffn_hidden_size :].clone()
        out[dst + "mlp.down_proj.weight"] = _take(mc, src + "mlp.linear_fc2.weight", (h, L.ffn_hidden_size))
    attn_norm, mlp_norm = _norm_names(L, i)
    out[dst + "input_layernorm.weight"] = _take(mc, attn_norm, (h,))
    out[dst + "post_attention_layernorm.weight"] = _take(mc, mlp_norm, (h,))
    return out


# ---- tensor parallel ------------------------------------------------------------------------

_SPLIT_ROWS = re.compile(r"(word_embeddings\.weight|output_layer\.weight|linear_qkv\.(weight|bias))$")
_SPLIT_COLS = re.compile(r"(linear_proj\.weight|linear_fc2\.weight)$")
_FC1 = re.compile(r"linear_fc1\.weight$")


def split_tp(state: State, layout: Layout, tp: int) -> list[State]:
    """An unsharded megatron-core state dict (vocabulary padded for `tp`) as `tp` rank shards."""
    layout.check_parallel(tp, 1)
    shards: list[State] = [{} for _ in range(tp)]
    for name, t in state.items():
        if is_expert(name):  # split over EP x ETP ranks, not TP ones (split_experts)
            for whole in shards:
                whole[name] = t
            continue
        if ("word_embeddings" in name or name == "output_layer.weight") and t.shape[
            0
        ] != layout.padded_vocab_size(tp):
            # megatron-core builds VocabParallelEmbedding with padded_vocab_size(tp) / tp rows per rank.
            raise ConversionError(
                f"{name}: {t.shape[0]} vocabulary rows, but TP {tp} with --make-vocab-size-divisible-by "
                f"{layout.make_vocab_size_divisible_by} needs {layout.padded_vocab_size(tp)} "
                f"({layout.padded_vocab_size(tp) // tp} per rank); re-pad the vocabulary for this TP (repad_vocab)"
            )
        if _SPLIT_ROWS.search(name):
            # QKV rows are whole query groups per rank (the grouped layout keeps each group together).
            parts = t.chunk(tp, dim=0)
        elif _SPLIT_COLS.search(name):
            parts = t.chunk(tp, dim=1)
        elif _FC1.search(name):
            parts = split_fc1(t, tp)
        else:
            parts = (t,) * tp
        for shard, part in zip(shards, parts, strict=True):
            shard[name] = part.clone()
    return shards


def merge_tp(shards: list[State], layout: Layout) -> State:
    """The inverse of split_tp; replicated tensors must agree across ranks."""
    out: State = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        if is_expert(name):  # whole in every TP shard (merge_experts joins EP x ETP parts)
            out[name] = parts[0]
        elif _SPLIT_ROWS.search(name):
            out[name] = torch.cat(parts, dim=0)
        elif _SPLIT_COLS.search(name):
            out[name] = torch.cat(parts, dim=1)
        elif _FC1.search(name):
            out[name] = merge_fc1(parts)
        else:
            for r, p in enumerate(parts[1:], start=1):
                if not torch.equal(p, parts[0]):
                    raise ConversionError(f"{name} is replicated but TP rank {r} differs from rank 0")
            out[name] = parts[0]
    return out


# ---- expert parallel ------------------------------------------------------------------------


def split_fc1(t: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    gate, up = t.chunk(2, dim=0)
    return tuple(torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(n), up.chunk(n), strict=True))


def merge_fc1(parts: list[torch.Tensor]) -> torch.Tensor:
    halves = [p.chunk(2, dim=0) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def split_experts(state: State, layout: Layout, ep: int, etp: int) -> dict[tuple[int, int], State]:
    """The expert tensors of `state` (global ids, whole) as (EP rank, ETP rank) -> that rank's
    experts, numbered from 0, each split over ETP as a dense MLP over TP. Other tensors are left
    out (they follow TP: split_tp)."""
    layout.check_parallel(1, 1, ep, etp)
    per = layout.num_experts // ep if layout.num_experts else 1
    out: dict[tuple[int, int], State] = {(r, t): {} for r in range(ep) for t in range(etp)}
    for name, tensor in state.items():
        parsed = parse_expert(name)
        if parsed is None:
            continue
        layer, e, which = parsed
        local = expert_names(layout, layer, e % per)[which]
        parts = split_fc1(tensor, etp) if which == 0 else tensor.chunk(etp, dim=1)
        for t, part in enumerate(parts):
            out[(e // per, t)][local] = part.clone()
    return out


def merge_experts(parts: Mapping[tuple[int, int], State], layout: Layout) -> State:
    """The inverse of split_experts: every (EP rank, ETP rank) part -> whole experts, global ids."""
    ep, etp = _grid(parts, "expert shards", "(EP rank, ETP rank)")
    per = layout.num_experts // ep
    out: State = {}
    for name in parts[(0, 0)]:
        parsed = parse_expert(name)
        if parsed is None:
            continue
        layer, e, which = parsed
        for r in range(ep):
            pieces = [parts[(r, t)][name] for t in range(etp)]
            whole = merge_fc1(pieces) if which == 0 else torch.cat(pieces, dim=1)
            out[expert_names(layout, layer, r * per + e)[which]] = whole
    return out


def rank_shard(stage: State, layout: Layout, tp: int, tp_rank: int, ep: int = 1, etp: int = 1, ep_rank: int = 0,
               etp_rank: int = 0) -> State:  # fmt: skip
    """One rank's tensors of an unsharded pipeline stage: its TP part of the dense tensors and its
    EP x ETP part of the experts (`stage` may hold only some experts, with global ids)."""
    dense = {k: v for k, v in stage.items() if not is_expert(k)}
    out = split_tp(dense, layout, tp)[tp_rank] if dense else {}
    experts = {k: v for k, v in stage.items() if is_expert(k)}
    if experts:
        out.update(split_experts(experts, layout, ep, etp)[(ep_rank, etp_rank)])
    return out


def repad_vocab(state: State, layout: Layout, tp: int) -> State:
    """The vocabulary rows padded for another TP (real rows kept, padding zero)."""
    rows = layout.padded_vocab_size(tp)
    out = dict(state)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in out:
            out[name] = _pad_rows(out[name][: layout.vocab_size], rows)
    return out


# ---- pipeline parallel ----------------------------------------------------------------------

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """The global layers of each stage: num_layers / pp consecutive layers each."""
    per = num_layers // pp
    return [range(s * per, (s + 1) * per) for s in range(pp)]


def split_pp(state: State, layout: Layout, pp: int) -> list[State]:
    """Stages with layers renumbered from 0; embedding on the first, final norm and output layer
    on the last (tied embeddings: the last stage gets `output_layer.weight`, a copy)."""
    layout.check_parallel(1, pp)
    stages: list[State] = [{} for _ in range(pp)]
    owner = {g: (s, g - r.start) for s, r in enumerate(stage_layers(layout.num_layers, pp)) for g in r}
    for name, t in state.items():
        m = _LAYER.match(name)
        if m:
            s, local = owner[int(m.group(1))]
            stages[s][f"decoder.layers.{local}.{m.group(2)}"] = t
        elif name.startswith("embedding."):
            stages[0][name] = t
            if layout.tied_embeddings and pp > 1:
                stages[-1]["output_layer.weight"] = t.clone()
        else:
            stages[-1][name] = t
    return stages


def merge_pp(stages: list[State], layout: Layout) -> State:
    """The inverse of split_pp (a tied output layer on the last stage must equal the embedding)."""
    pp = len(stages)
    out: State = {}
    for s, (stage, layers) in enumerate(zip(stages, stage_layers(layout.num_layers, pp), strict=True)):
        for name, t in stage.items():
            m = _LAYER.match(name)
            if m:
                local = int(m.group(1))
                if local >= len(layers):
                    raise ConversionError(f"stage {s} holds {name}, but has only {len(layers)} layers")
                out[f"decoder.layers.{layers.start + local}.{m.group(2)}"] = t
            elif name == "output_layer.weight" and layout.tied_embeddings:
                emb = stages[0].get("embedding.word_embeddings.weight")
                if emb is None or not torch.equal(emb, t):
                    raise ConversionError(
                        "tied embeddings: the last stage's output_layer.weight differs from the embedding"
                    )
            else:
                out[name] = t
    return out


def _grid(parts: Mapping[tuple[int, int], Any], what: str, keys: str) -> tuple[int, int]:
    """The sizes of a two-dimensional grid of shards, refusing a hole in it."""
    rows, cols = 1 + max(a for a, _ in parts), 1 + max(b for _, b in parts)
    missing = [(a, b) for a in range(rows) for b in range(cols) if (a, b) not in parts]
    if missing:
        raise ConversionError(f"{what} missing for {keys} {missing}")
    return rows, cols
