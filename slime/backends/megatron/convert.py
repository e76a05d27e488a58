"""Hugging Face <-> megatron-core (GPTModel) state dicts. Pure tensor code: no megatron-core
import, runs on CPU. The TP / EP / PP resharding of these state dicts is
slime.backends.megatron.sharding's.

Megatron-side names are megatron-core's GPTModel names: `embedding.word_embeddings.weight`
([padded vocab / TP, hidden], split dim 0), each layer's tensors (slime.backends.megatron.layer_map,
the one table of which HF tensors make which megatron-core tensor: fused QKV and MLA's per-head
projections split dim 0 over TP, linear_proj and linear_fc2 dim 1, [gate; up] as [gate_r; up_r],
norms replicated), `decoder.final_layernorm.weight` and `output_layer.weight` (untied only, as the
embedding). A mixture-of-experts layer's experts are megatron-core's SequentialMLP
(`mlp.experts.local_experts.{e}.linear_fc1 / fc2.weight`) or, with `Layout.grouped_experts`, its
TEGroupedMLP (`mlp.experts.linear_fc1.weight{e}`).

Experts are split over expert-parallel (EP) ranks, E / EP consecutive experts each, numbered from 0 on every
rank, and each expert over expert-tensor-parallel (ETP) ranks as a dense MLP over TP ranks ([gate_r; up_r]
rows of fc1, columns of fc2). The TP split leaves experts whole (slime.backends.megatron.sharding: `split_tp`;
`split_experts` / `merge_experts` do EP and ETP). The shards of whole checkpoints (one per file) are
slime.backends.megatron.rank_files'.

Fused QKV layout (megatron-core's): for each of the `num_query_groups` (= HF num_key_value_heads)
groups, its `heads / groups` query heads, then its key head, then its value head, each head_dim
rows. The vocabulary is padded to a multiple of `make_vocab_size_divisible_by x TP` with zero rows
(Megatron's rule), which are removed again on the way back. Pipeline stages hold consecutive
layers renumbered from 0 on each stage; the first stage holds the embedding, the last the final
norm and output layer (with tied embeddings the last stage holds `output_layer.weight`, a copy
of the embedding, as megatron-core does when PP > 1).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

# (what the Layout reads of each family's config, and the per-layer table, sit below this module;
# the names other modules take from here are re-exported)
from slime.backends.megatron.families import SUPPORTED, hybrid_fields, mla_fields, moe_fields
from slime.backends.megatron.families import ConversionError as ConversionError
from slime.backends.megatron.families import mla_yarn as mla_yarn
from slime.backends.megatron.families import rope_theta as rope_theta
from slime.backends.megatron.layer_map import expert_names as expert_names
from slime.backends.megatron.layer_map import layer_pairs, mtp_shared_copies
from slime.utils.model_families import Family

State = dict[str, torch.Tensor]


def convertible_family(config: Any) -> Family:
    """The registry's family of `config` (slime.utils.model_families), one the backend builds;
    ConversionError naming what the conversion does not build (another family, quantized weights,
    a rope scaling or an activation megatron-core is not built with here, an output projection
    bias)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        from slime.utils.model_families import megatron_refusal

        raise ConversionError(
            f"model_type {model_type!r}: {megatron_refusal(model_type) or 'not converted'} (the Megatron "
            f"backend and conversion build {', '.join(SUPPORTED)}; docs/models.md)"
        )
    quantized = getattr(config, "quantization_config", None)
    if quantized:
        method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
        raise ConversionError(
            f"model_type {model_type!r} with quantization_config ({method}): its weights are stored "
            "quantized (FP8 blocks with separate scales), which the conversion does not read; convert "
            "a bfloat16 copy"
        )
    rope_theta(config)  # refuses a rope scaling megatron-core's GPTModel is not built with here
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ConversionError(f"hidden_act {config.hidden_act!r}: only SiLU-gated MLPs are converted")
    family = SUPPORTED[model_type]
    bias = bool(getattr(config, "attention_bias", False))
    if bias and family.output_bias:
        raise ConversionError(
            f"model_type {model_type!r} with attention_bias: the output projection's bias is not converted"
        )
    return family


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
    model_type: str = ""
    rotary_percent: float = 1.0
    """The rotated share of each head (GLM: 0.5)."""
    rotary_interleaved: bool = False
    """Rotary pairs are neighbouring channels (GLM-4), not the two halves."""
    post_norms: bool = False
    """GLM-4's sandwich norms: one after attention and one after the MLP, before each residual add."""
    fused_gate_up: bool = False
    """The HF checkpoint stores a dense MLP's [gate; up] as one `mlp.gate_up_proj` (GLM-4)."""
    shared_ffn_hidden_size: int = 0
    """The shared experts' MLP width (0: none), beside the routed ones in every MoE layer."""
    expert_bias: bool = False
    """The router's per-expert score correction (aux-loss-free routing: DeepSeek-V3, GLM-4.5+)."""
    kv_lora_rank: int = 0
    """Multi-latent attention (DeepSeek-V3) when > 0: the compressed key/value latent's width;
    `head_dim` is then each head's key width without its rotary part (qk_nope_head_dim)."""
    q_lora_rank: int = 0
    """MLA: the query latent's width (0: queries projected directly)."""
    qk_rope_head_dim: int = 0
    """MLA: each head's rotary query/key part (the key's is shared by all heads)."""
    v_head_dim: int = 0
    """MLA: each head's value width (0: head_dim)."""
    linear_layers: tuple[int, ...] = ()
    """1 for each gated delta-net (linear-attention) layer, 0 for a full-attention one (Qwen3-Next,
    Qwen3.5; empty: every layer is full attention)."""
    linear_shape: tuple[int, ...] = ()
    """The gated delta-net's (key heads, value heads, key head dim, value head dim, conv kernel)."""
    linear_split_proj: bool = False
    """Qwen3.5's projections in_proj_qkv / in_proj_z / in_proj_b / in_proj_a (Qwen3-Next fuses
    them as in_proj_qkvz / in_proj_ba)."""
    gated_attention: bool = False
    """The full-attention layers gate their output per head (HF q_proj rows: each head's query,
    then its gate; megatron-core's attention_output_gate)."""
    zero_centered_norm: bool = False
    """The RMSNorms scale by 1 + weight (Megatron-LM's --apply-layernorm-1p)."""
    shared_expert_gate: bool = False
    """The shared expert's output is scaled by a sigmoid gate (Qwen3-Next, Qwen3.5-MoE)."""
    shared_expert_name: str = "shared_experts"
    """The HF module of the shared experts (the Qwen families: `shared_expert`)."""
    mtp_layers: int = 0
    """Multi-token prediction modules built (`--mtp-num-layers`; the checkpoint's
    num_nextn_predict_layers is their most): HF layers num_layers .. num_layers + mtp_layers - 1."""

    def __post_init__(self) -> None:
        for name in ("moe_layers", "linear_layers", "linear_shape"):  # a stored list too
            object.__setattr__(self, name, tuple(int(x) for x in getattr(self, name)))

    def is_moe(self, layer: int) -> bool:
        """Layer `layer` routes to experts (an MTP module's layer, past the decoder, is built with
        the last decoder layer's spec, as megatron-core builds it)."""
        return bool(self.num_experts) and bool(self.moe_layers[min(layer, self.num_layers - 1)])

    def is_linear(self, layer: int) -> bool:
        """Layer `layer` is a gated delta-net (linear-attention) layer."""
        return bool(self.linear_layers) and bool(self.linear_layers[min(layer, self.num_layers - 1)])

    @property
    def all_layers(self) -> range:
        """The decoder's layers and then the MTP modules' (HF numbering)."""
        return range(self.num_layers + self.mtp_layers)

    @property
    def value_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    def mla_args(self) -> dict[str, Any]:
        """Multi-latent attention's dimensions in Megatron-LM's names (none for other attention)."""
        if not self.kv_lora_rank:
            return {}
        return {
            "multi_latent_attention": True,
            "q_lora_rank": self.q_lora_rank or None,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_head_dim": self.head_dim,
            "qk_pos_emb_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.value_dim,
        }

    @classmethod
    def from_hf_config(
        cls,
        config: Any,
        make_vocab_size_divisible_by: int = 128,
        fold_norms: bool = False,
        stages: tuple[int | None, int | None] = (None, None),
        mtp_layers: int = 0,
    ) -> Layout:
        """A config of one of the SUPPORTED families (SiLU-gated MLPs, RMSNorm); `stages`: the
        first and last pipeline stage's layers (uneven stages; None: as the others); `mtp_layers`:
        the multi-token prediction modules to build, at most the checkpoint's. A released Qwen3.5
        (vision-language) config gives its language model's layout (model_families.text_config)."""
        from slime.utils.model_families import text_config

        config = text_config(config)
        family = convertible_family(config)
        model_type = config.model_type
        bias = bool(getattr(config, "attention_bias", False))
        from slime.config.architecture import partial_rotary

        heads = config.num_attention_heads
        attention: dict[str, Any] = {
            "num_query_groups": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
            "rotary_percent": partial_rotary(config),
            "rotary_interleaved": family.glm_layers,
        }
        if getattr(config, "kv_lora_rank", None):
            attention = mla_fields(config, bias)
        if family.hybrid:
            attention.update(hybrid_fields(config))
        if mtp_layers:
            has = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
            if mtp_layers > has:
                raise ConversionError(
                    f"--mtp-num-layers {mtp_layers}: the checkpoint has {has} multi-token prediction layers "
                    f"(config.json num_nextn_predict_layers); give at most {has}"
                    + ("" if has else " (drop the flag: this model has none)")
                )
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=heads,
            # (Qwen3.5-MoE routes every layer: no dense MLP width in its config)
            ffn_hidden_size=int(getattr(config, "intermediate_size", None) or config.moe_intermediate_size),
            vocab_size=config.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias or bias,
            qk_norm=family.qk_norm or bool(getattr(config, "use_qk_norm", False)),
            make_vocab_size_divisible_by=make_vocab_size_divisible_by,
            fold_norms=fold_norms,
            first_stage_layers=stages[0],
            last_stage_layers=stages[1],
            model_type=model_type,
            post_norms=family.glm_layers,
            fused_gate_up=family.glm_layers,
            mtp_layers=mtp_layers,
            **attention,
            **moe_fields(config),
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
                    f"PP {pp} must divide the model's {self.num_layers} layers (or set the first / last "
                    "stage's with --decoder-first-pipeline-num-layers / "
                    "--decoder-last-pipeline-num-layers)"
                )
            split = (
                f"{left} layers are left for {len(rest)} stages, which must split them evenly"
                if rest
                else (f"the two stages hold {self.num_layers - left}")
            )
            raise ConversionError(
                f"PP {pp} with --decoder-first/last-pipeline-num-layers {sizes[0]}/{sizes[-1]} does not "
                f"split the model's {self.num_layers} layers: {split}"
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
        if self.shared_ffn_hidden_size % tp:
            raise ConversionError(
                f"TP {tp} must divide the shared experts' MLP size {self.shared_ffn_hidden_size}"
            )
        latent = (
            {
                "q_lora_rank": self.q_lora_rank,
                "kv_lora_rank + qk_rope_head_dim": self.kv_lora_rank + self.qk_rope_head_dim,
            }
            if self.kv_lora_rank and not self.fold_norms
            else {}
        )
        for what, n in latent.items():  # megatron-core's local spec splits MLA's latent projections
            if n % tp:
                raise ConversionError(f"TP {tp} must divide multi-latent attention's {what} ({n})")
        if self.mtp_layers and self.tied_embeddings and pp > 1:
            raise ConversionError(
                f"PP {pp} with multi-token prediction and tied embeddings is not built (megatron-core "
                "keeps the tied weight in the MTP stage's embedding, not its output layer); use PP 1"
            )
        self.stages(pp)  # the layers each stage holds (uneven stages: the flags that set them)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: the vocabulary rounded up to a multiple of divisible_by x TP."""
    if divisible_by < 1:
        raise ConversionError(f"--make-vocab-size-divisible-by must be >= 1, got {divisible_by}")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


# ---- HF <-> Megatron (unsharded) ------------------------------------------------------------


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
    for i in layout.all_layers:
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


def layer_to_megatron(
    hf: Mapping[str, torch.Tensor], layout: Layout, i: int, experts: range | None = None
) -> State:
    """Layer i, unsharded; of a MoE layer only `experts` (global ids; None: all)."""
    return {
        p.mc: p.to_megatron(
            [_take(hf, n, s) for n, s in zip(p.hf, p.shapes, strict=True)], layout.num_query_groups
        )
        for p in layer_pairs(layout, i, experts)
    }


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
    for i in range(L.num_layers, L.num_layers + L.mtp_layers):
        out.update(layer_to_hf(mc, L, i))
        out.update({copy: out[own].clone() for copy, own in mtp_shared_copies(L, i).items()})
    return out


def layer_to_hf(mc: State, layout: Layout, i: int) -> State:
    """Layer i's HF tensors from its megatron-core tensors (`decoder.layers.{i}.*`, unsharded)."""
    out: State = {}
    for p in layer_pairs(layout, i):
        parts = p.to_hf(_take(mc, p.mc, p.mc_shape), layout.num_query_groups)
        out.update(zip(p.hf, parts, strict=True))
    return out
