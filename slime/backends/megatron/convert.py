"""Hugging Face <-> megatron-core (GPTModel) state dicts. Pure tensor code: no megatron-core
import, runs on CPU. The TP / EP / PP resharding of these state dicts is
slime.backends.megatron.sharding's.

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
(slime.backends.megatron.sharding: `split_tp`; `split_experts` / `merge_experts` do EP and ETP). The shards of whole checkpoints
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
    first_stage_layers: int | None = None
    """`--decoder-first-pipeline-num-layers`: the first pipeline stage's layers (None: as the others)."""
    last_stage_layers: int | None = None
    """`--decoder-last-pipeline-num-layers`: the last pipeline stage's layers (None: as the others)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(int(x) for x in self.moe_layers))  # a stored list too

    def is_moe(self, layer: int) -> bool:
        return bool(self.num_experts) and bool(self.moe_layers[layer])

    @classmethod
    def from_hf_config(
        cls, config: Any, make_vocab_size_divisible_by: int = 128, fold_norms: bool = False,
        stages: tuple[int | None, int | None] = (None, None),
    ) -> Layout:  # fmt: skip
        """Qwen2, Qwen3 and Llama configs (dense, SiLU-gated MLP, RMSNorm); `stages`: the first and
        last pipeline stage's layers (uneven stages; None: as the others)."""
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED:
            from slime.utils.model_families import megatron_refusal

            raise ConversionError(
                f"model_type {model_type!r}: {megatron_refusal(model_type) or 'not converted'} (the Megatron "
                f"backend and conversion build {', '.join(SUPPORTED)}; docs/models.md)"
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
            first_stage_layers=stages[0],
            last_stage_layers=stages[1],
            **moe,
        )

    def stages(self, pp: int) -> list[range]:
        """The global layers of each of `pp` pipeline stages, in Megatron-LM's rule: the first and
        last stage hold what --decoder-first/last-pipeline-num-layers say, the other stages split
        the remaining layers evenly. ConversionError names the flags when that does not fit."""
        if pp <= 1:  # one stage holds every layer (the per-dimension checks ask with PP 1)
            return [range(self.num_layers)]
        uneven = self.first_stage_layers is not None or self.last_stage_layers is not None
        sizes: list[int | None] = [None] * pp
        if self.first_stage_layers is not None:
            sizes[0] = self.first_stage_layers
        if self.last_stage_layers is not None:
            sizes[-1] = self.last_stage_layers
        if any(n is not None and n < 1 for n in sizes):
            raise ConversionError(
                f"every pipeline stage needs at least one layer, got first/last {sizes[0]}/{sizes[-1]}"
            )
        rest = [k for k, n in enumerate(sizes) if n is None]
        left = self.num_layers - sum(n for n in sizes if n is not None)
        if (rest and (left < len(rest) or left % len(rest))) or (not rest and left):
            if not uneven:
                raise ConversionError(
                    f"PP {pp} must divide the model's {self.num_layers} layers (or set the first / last stage's "
                    "with --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers)"
                )
            split = f"{left} layers are left for {len(rest)} stages, which must split them evenly" if rest else (
                f"the two stages hold {self.num_layers - left}")  # fmt: skip
            raise ConversionError(
                f"PP {pp} with --decoder-first/last-pipeline-num-layers {sizes[0]}/{sizes[-1]} does not split the "
                f"model's {self.num_layers} layers: {split}"
            )
        for k in rest:
            sizes[k] = left // len(rest)
        starts = [sum(n or 0 for n in sizes[:k]) for k in range(pp)]
        return [range(start, start + (n or 0)) for start, n in zip(starts, sizes, strict=True)]

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
        self.stages(pp)  # the layers each stage holds (uneven stages: the flags that set them)


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


def pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
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
    out = embedding_to_megatron(hf, layout, tp)
    for i in range(layout.num_layers):
        out.update(layer_to_megatron(hf, layout, i))
    out.update(final_to_megatron(hf, layout, tp))
    return out


def embedding_to_megatron(hf: Mapping[str, torch.Tensor], layout: Layout, tp: int) -> State:
    emb = _take(hf, "model.embed_tokens.weight", (layout.vocab_size, layout.hidden_size))
    return {"embedding.word_embeddings.weight": pad_rows(emb, layout.padded_vocab_size(tp))}


def final_to_megatron(hf: Mapping[str, torch.Tensor], layout: Layout, tp: int, lm_head: bool = True) -> State:
    out = {"decoder.final_layernorm.weight": _take(hf, "model.norm.weight", (layout.hidden_size,))}
    if lm_head and not layout.tied_embeddings:
        head = _take(hf, "lm_head.weight", (layout.vocab_size, layout.hidden_size))
        out["output_layer.weight"] = pad_rows(head, layout.padded_vocab_size(tp))
    return out


def layer_to_megatron(hf: Mapping[str, torch.Tensor], layout: Layout, i: int,
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
