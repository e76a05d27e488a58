"""Which Hugging Face tensors make which megatron-core tensor, per decoder layer: one table
(`layer_pairs`) that the conversion both ways (slime.backends.megatron.convert) and the export's
shapes (slime.backends.megatron.export) read, so a family's names are written once.

A `Pair` joins one megatron-core tensor to the HF tensors it is made of, with their HF shapes and
how they combine:

- `same`: one HF tensor is the megatron-core tensor (a rename);
- `cat`: the HF tensors stacked along rows ([gate; up] into linear_fc1);
- `qkv`: query, key and value grouped by query group (megatron-core's fused QKV: for each of the
  `num_query_groups` groups its query heads, then its key head, then its value head);
- `gated_qkv`: the same with an output gate (HF's q_proj holds each head's query and then its
  gate; megatron-core's group holds its query heads, then their gates, then the key and value).

Megatron-side names are megatron-core's (and, for the families slime builds with layer specs of
its own, slime's: GLM-4's `post_self_attn_layernorm` / `post_mlp_layernorm`):

    GQA attention   self_attention.linear_qkv.{weight,bias}, q_layernorm / k_layernorm, linear_proj
    gated delta-net self_attention.input_layernorm, self_attention.linear_attn.* (HF's names under
                    linear_attn: Qwen3-Next's in_proj_qkvz / in_proj_ba or Qwen3.5's in_proj_qkv /
                    in_proj_z / in_proj_b / in_proj_a, conv1d, dt_bias, A_log, norm, out_proj)
    MLA attention   self_attention.linear_q_proj (no query latent) or linear_q_down_proj,
                    q_layernorm and linear_q_up_proj; linear_kv_down_proj (latent + rotary key),
                    kv_layernorm, linear_kv_up_proj (per head: key, value); linear_proj
                    (Transformer Engine's spec folds q_layernorm / kv_layernorm into
                    linear_q_up_proj / linear_kv_up_proj as layer_norm_weight)
    dense MLP       mlp.linear_fc1 ([gate; up]), mlp.linear_fc2
    MoE MLP         mlp.router.weight, mlp.router.expert_bias (aux-loss-free routing),
                    mlp.experts.* (convert.expert_names), mlp.shared_experts.linear_fc1 / fc2,
                    mlp.shared_experts.gate_weight (Qwen3-Next / Qwen3.5-MoE's shared_expert_gate)
    norms           input_layernorm, pre_mlp_layernorm (TE: folded into linear_qkv / linear_fc1),
                    post_self_attn_layernorm, post_mlp_layernorm (GLM-4's sandwich norms)

Multi-token prediction (`Layout.mtp_layers`, DeepSeek-V3 / GLM-4.5+'s MTP modules) is numbered on
after the decoder: HF layer `num_layers + k` is megatron-core's `mtp.layers.{k}`, its decoder
layer under `transformer_layer.` (with the spec of the model's last layer, as megatron-core
builds it), beside `enorm`, `hnorm`, `eh_proj` and `final_layernorm` (HF: `shared_head.norm`).
The HF checkpoint also stores the module's copies of the embedding and the output head
(`embed_tokens`, `shared_head.head`), which megatron-core shares with the model's own
(`mtp_shared_copies`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

Shape = tuple[int, ...]
Layout = Any
"""slime.backends.megatron.convert.Layout (which imports this module: the table sits below it)."""


@dataclass(frozen=True)
class Pair:
    mc: str
    hf: tuple[str, ...]
    shapes: tuple[Shape, ...]
    kind: str = "same"

    def to_megatron(self, tensors: list[torch.Tensor], groups: int) -> torch.Tensor:
        if self.kind == "same":
            return tensors[0]
        if self.kind == "cat":
            return torch.cat(tensors, dim=0)
        rest = tensors[0].shape[1:]  # (hidden,) for weights, () for biases
        if self.kind == "gated_qkv":  # per head [query; gate] -> per group [queries; gates]
            q, d = tensors[0], self.shapes[1][0] // groups
            q = q.reshape(groups, -1, 2, d, *rest).transpose(1, 2)
            tensors = [q, *tensors[1:]]
        return torch.cat([t.reshape(groups, -1, *rest) for t in tensors], dim=1).reshape(-1, *rest)

    def to_hf(self, t: torch.Tensor, groups: int) -> list[torch.Tensor]:
        if self.kind == "same":
            return [t]
        if self.kind == "cat":
            return [p.clone() for p in t.split([s[0] for s in self.shapes], dim=0)]
        rest = t.shape[1:]
        parts = list(t.reshape(groups, -1, *rest).split([s[0] // groups for s in self.shapes], dim=1))
        if self.kind == "gated_qkv":
            d = self.shapes[1][0] // groups
            parts[0] = parts[0].reshape(groups, 2, -1, d, *rest).transpose(1, 2)
        return [p.reshape(-1, *rest).clone() for p in parts]

    @property
    def mc_shape(self) -> Shape:
        if self.kind == "same":
            return self.shapes[0]
        return (sum(s[0] for s in self.shapes), *self.shapes[0][1:])


def layer_prefix(layout: Layout, i: int) -> str:
    """Layer i's megatron-core name prefix: a decoder layer, or past them an MTP module's layer."""
    if i < layout.num_layers:
        return f"decoder.layers.{i}."
    return f"mtp.layers.{i - layout.num_layers}.transformer_layer."


def layer_pairs(layout: Layout, i: int, experts: range | None = None) -> list[Pair]:
    """Layer i's tensors (i >= num_layers: MTP module i - num_layers, with its own tensors); of a
    MoE layer only `experts` (global ids; None: all)."""
    src, dst = f"model.layers.{i}.", layer_prefix(layout, i)
    attention = _linear_attention(layout, src, dst) if layout.is_linear(i) else _attention(layout, src, dst)
    pairs = attention + _mlp(layout, i, src, dst, experts)
    h = (layout.hidden_size,)
    attn_norm, mlp_norm = norm_names(layout, i)
    pairs += [
        Pair(attn_norm, (src + "input_layernorm.weight",), (h,)),
        Pair(mlp_norm, (src + "post_attention_layernorm.weight",), (h,)),
    ]
    if layout.post_norms:
        pairs += [
            Pair(dst + "post_self_attn_layernorm.weight", (src + "post_self_attn_layernorm.weight",), (h,)),
            Pair(dst + "post_mlp_layernorm.weight", (src + "post_mlp_layernorm.weight",), (h,)),
        ]
    if i >= layout.num_layers:  # the MTP module around the layer
        m = f"mtp.layers.{i - layout.num_layers}."
        pairs += [
            Pair(m + "enorm.weight", (src + "enorm.weight",), (h,)),
            Pair(m + "hnorm.weight", (src + "hnorm.weight",), (h,)),
            # [embedding; hidden] -> hidden, in that order in both
            Pair(
                m + "eh_proj.weight",
                (src + "eh_proj.weight",),
                ((layout.hidden_size, 2 * layout.hidden_size),),
            ),
            Pair(m + "final_layernorm.weight", (src + "shared_head.norm.weight",), (h,)),
        ]
    return pairs


def mtp_shared_copies(layout: Layout, i: int) -> dict[str, str]:
    """MTP layer i's HF copies of the model's embedding and output head (HF name -> the model's)."""
    head = "model.embed_tokens.weight" if layout.tied_embeddings else "lm_head.weight"
    return {
        f"model.layers.{i}.embed_tokens.weight": "model.embed_tokens.weight",
        f"model.layers.{i}.shared_head.head.weight": head,
    }


def norm_names(layout: Layout, i: int) -> tuple[str, str]:
    p = layer_prefix(layout, i)
    if layout.is_linear(i):  # the delta-net's input norm is its attention module's (either spec)
        return p + "self_attention.input_layernorm.weight", norm_names_full(layout, i, p)[1]
    return norm_names_full(layout, i, p)


def norm_names_full(layout: Layout, i: int, p: str) -> tuple[str, str]:
    if layout.fold_norms:
        # A MoE layer keeps a norm of its own before the router (no fused linear to fold it into).
        mlp = p + ("pre_mlp_layernorm.weight" if layout.is_moe(i) else "mlp.linear_fc1.layer_norm_weight")
        if layout.kv_lora_rank:  # MLA under TE: the input norm stays a module of its own
            return p + "input_layernorm.weight", mlp
        return p + "self_attention.linear_qkv.layer_norm_weight", mlp
    return p + "input_layernorm.weight", p + "pre_mlp_layernorm.weight"


def _attention(L: Layout, src: str, dst: str) -> list[Pair]:
    h, nq = L.hidden_size, L.num_heads
    a, s = dst + "self_attention.", src + "self_attn."
    out = [Pair(a + "linear_proj.weight", (s + "o_proj.weight",), ((h, nq * L.value_dim),))]
    if L.kv_lora_rank:  # multi-latent attention
        q_dim = L.head_dim + L.qk_rope_head_dim
        if L.q_lora_rank:
            q_norm = a + ("linear_q_up_proj.layer_norm_weight" if L.fold_norms else "q_layernorm.weight")
            out += [
                Pair(a + "linear_q_down_proj.weight", (s + "q_a_proj.weight",), ((L.q_lora_rank, h),)),
                Pair(q_norm, (s + "q_a_layernorm.weight",), ((L.q_lora_rank,),)),
                Pair(a + "linear_q_up_proj.weight", (s + "q_b_proj.weight",), ((nq * q_dim, L.q_lora_rank),)),
            ]
        else:
            out.append(Pair(a + "linear_q_proj.weight", (s + "q_proj.weight",), ((nq * q_dim, h),)))
        kv_norm = a + ("linear_kv_up_proj.layer_norm_weight" if L.fold_norms else "kv_layernorm.weight")
        kv_up = (nq * (L.head_dim + L.v_head_dim), L.kv_lora_rank)
        return [
            *out,
            Pair(
                a + "linear_kv_down_proj.weight",
                (s + "kv_a_proj_with_mqa.weight",),
                ((L.kv_lora_rank + L.qk_rope_head_dim, h),),
            ),
            Pair(kv_norm, (s + "kv_a_layernorm.weight",), ((L.kv_lora_rank,),)),
            Pair(a + "linear_kv_up_proj.weight", (s + "kv_b_proj.weight",), (kv_up,)),
        ]
    d, ng = L.head_dim, L.num_query_groups
    gate = 2 if L.gated_attention else 1
    q, kv, kind = (gate * nq * d, h), (ng * d, h), "gated_qkv" if L.gated_attention else "qkv"
    names = tuple(s + f"{x}_proj.weight" for x in "qkv")
    out.append(Pair(a + "linear_qkv.weight", names, (q, kv, kv), kind))
    if L.qkv_bias:
        biases = tuple(s + f"{x}_proj.bias" for x in "qkv")
        out.append(Pair(a + "linear_qkv.bias", biases, ((gate * nq * d,), (ng * d,), (ng * d,)), kind))
    if L.qk_norm:
        out += [
            Pair(a + "q_layernorm.weight", (s + "q_norm.weight",), ((d,),)),
            Pair(a + "k_layernorm.weight", (s + "k_norm.weight",), ((d,),)),
        ]
    return out


def _linear_attention(L: Layout, src: str, dst: str) -> list[Pair]:
    """A gated delta-net layer's tensors: transformers' module under the same names."""
    h = L.hidden_size
    nk, nv, dk, dv, kernel = L.linear_shape
    conv = 2 * nk * dk + nv * dv
    shapes: dict[str, tuple[int, ...]] = {
        "conv1d.weight": (conv, 1, kernel),
        "dt_bias": (nv,),
        "A_log": (nv,),
        "norm.weight": (dv,),
        "out_proj.weight": (h, nv * dv),
    }
    if L.linear_split_proj:  # Qwen3.5
        shapes.update(
            {
                "in_proj_qkv.weight": (conv, h),
                "in_proj_z.weight": (nv * dv, h),
                "in_proj_b.weight": (nv, h),
                "in_proj_a.weight": (nv, h),
            }
        )
    else:  # Qwen3-Next: per key head [q, k, v, z] rows, and [b, a]
        shapes.update({"in_proj_qkvz.weight": (conv + nv * dv, h), "in_proj_ba.weight": (2 * nv, h)})
    a, s = dst + "self_attention.linear_attn.", src + "linear_attn."
    return [Pair(a + n, (s + n,), (shape,)) for n, shape in sorted(shapes.items())]


def _mlp(L: Layout, i: int, src: str, dst: str, experts: range | None) -> list[Pair]:
    h = L.hidden_size
    if not L.is_moe(i):
        return _dense(src + "mlp.", dst + "mlp.", h, L.ffn_hidden_size, L.fused_gate_up)
    m = src + "mlp."
    out = [Pair(dst + "mlp.router.weight", (m + "gate.weight",), ((L.num_experts, h),))]
    if L.expert_bias:
        out.append(
            Pair(dst + "mlp.router.expert_bias", (m + "gate.e_score_correction_bias",), ((L.num_experts,),))
        )
    f = L.moe_ffn_hidden_size
    for e in range(L.num_experts) if experts is None else experts:
        fc1, fc2 = expert_names(L, i, e)
        x = m + f"experts.{e}."
        out += [
            Pair(fc1, (x + "gate_proj.weight", x + "up_proj.weight"), ((f, h), (f, h)), "cat"),
            Pair(fc2, (x + "down_proj.weight",), ((h, f),)),
        ]
    if L.shared_ffn_hidden_size:
        shared = m + L.shared_expert_name + "."
        out += _dense(shared, dst + "mlp.shared_experts.", h, L.shared_ffn_hidden_size, False)
    if L.shared_expert_gate:
        out.append(
            Pair(dst + "mlp.shared_experts.gate_weight", (m + "shared_expert_gate.weight",), ((1, h),))
        )
    return out


def expert_names(layout: Layout, layer: int, expert: int) -> tuple[str, str]:
    """(fc1, fc2) names of an expert of a MoE layer (`expert` numbered as the state dict does:
    globally when unsharded, from 0 on each EP rank when sharded)."""
    p = layer_prefix(layout, layer) + "mlp.experts."
    if layout.grouped_experts:
        return p + f"linear_fc1.weight{expert}", p + f"linear_fc2.weight{expert}"
    return p + f"local_experts.{expert}.linear_fc1.weight", p + f"local_experts.{expert}.linear_fc2.weight"


def _dense(src: str, dst: str, h: int, f: int, fused: bool) -> list[Pair]:
    fc1 = (
        Pair(dst + "linear_fc1.weight", (src + "gate_up_proj.weight",), ((2 * f, h),))
        if fused  # GLM-4 stores [gate; up] as one tensor, in megatron-core's order
        else Pair(
            dst + "linear_fc1.weight",
            (src + "gate_proj.weight", src + "up_proj.weight"),
            ((f, h), (f, h)),
            "cat",
        )
    )
    return [fc1, Pair(dst + "linear_fc2.weight", (src + "down_proj.weight",), ((h, f),))]


_EXPERT = re.compile(
    r"^(?:decoder\.layers\.(?P<layer>\d+)|mtp\.layers\.(?P<mtp>\d+)\.transformer_layer)\.mlp\.experts\."
    r"(?:local_experts\.(?P<e>\d+)\.(?P<fc>linear_fc[12])\.weight|(?P<gfc>linear_fc[12])\.weight(?P<ge>\d+))$"
)


def parse_expert(name: str, layout: Layout) -> tuple[int, int, int] | None:
    """(layer, expert, 0 for linear_fc1 or 1 for linear_fc2) of an expert tensor's name, else
    None; an MTP module's layer is numbered after the decoder's (layer_map.layer_prefix)."""
    m = _EXPERT.match(name)
    if not m:
        return None
    fc = m.group("fc") or m.group("gfc")
    expert = m.group("e") if m.group("e") is not None else m.group("ge")
    layer = int(m.group("layer")) if m.group("layer") is not None else layout.num_layers + int(m.group("mtp"))
    return layer, int(expert), 0 if fc == "linear_fc1" else 1


def is_expert(name: str) -> bool:
    return _EXPERT.match(name) is not None


def layer_of(module: str) -> int | None:
    """The decoder layer an HF module sits in (None: outside the layers, e.g. lm_head)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return None
