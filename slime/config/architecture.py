"""Megatron-LM's architecture flags against a Hugging Face config: the model a script describes
(`megatron_architecture`, with Megatron-LM's defaults for the switches left out), the model
--hf-checkpoint holds (`hf_architecture`), and one problem per flag that disagrees
(`architecture_problems`). The flags themselves are in slime.config.megatron_lm.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from typing import Any

from slime.config.megatron_lm import SLIME_SPECS, SPECS
from slime.config.surface import CHECKED, given
from slime.utils.model_families import layer_traits


def count_architecture_flags(ns: argparse.Namespace) -> int:
    """How many architecture flags were given (for the plan)."""
    return sum(given(ns, s) for s in SPECS if s.group == "architecture" and s.fsdp == CHECKED)


def model_described(ns: argparse.Namespace) -> bool:
    return any(getattr(ns, d) is not None for d in ("num_layers", "hidden_size", "num_attention_heads"))


# ---- the HF config in Megatron-LM's terms ---------------------------------------------------


@dataclass(frozen=True)
class HFArchitecture:
    """An HF config's model in Megatron-LM's flag values (dest -> value), and where each came
    from (dest -> config key) for the messages."""

    values: dict[str, Any]
    keys: dict[str, str] = field(default_factory=dict)


def rope_scaling(config: Any) -> tuple[str, float | None, float]:
    """An HF config's RoPE: (rope type, scaling factor or None, rotary base), from
    `rope_parameters` (transformers 5) or `rope_scaling` and `rope_theta` (before)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        params = {
            **(getattr(config, "rope_scaling", None) or {}),
            "rope_theta": getattr(config, "rope_theta", None),
        }
    kind = params.get("rope_type", params.get("type")) or "default"
    theta = params.get("rope_theta")
    return kind, params.get("factor"), float(theta) if theta is not None else 10000.0


def spec_problems(spec: list[str] | None, config: Any, where: str) -> list[str]:
    """slime's `--spec MODULE FUNCTION` against the checkpoint's model_type (another spec is
    refused by the flag itself)."""
    families = SLIME_SPECS.get((spec[0], spec[1])) if spec and len(spec) == 2 else None
    model_type = getattr(config, "model_type", "")
    if spec is None or families is None or model_type in families:
        return []
    return [
        f"--spec {' '.join(spec)} is slime's layer spec for model_type {', '.join(families)}; {where} is "
        f"{model_type!r} (drop --spec, or give the spec of this model)"
    ]


# Where each value of hf_architecture comes from in the HF config (shown with a mismatch).
HF_KEYS = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "ffn_hidden_size": "intermediate_size",
    "num_attention_heads": "num_attention_heads",
    "group_query_attention": "num_key_value_heads",
    "num_query_groups": "num_key_value_heads",
    "kv_channels": "head_dim",
    "vocab_size": "vocab_size",
    "max_position_embeddings": "max_position_embeddings",
    "swiglu": "hidden_act",
    "normalization": "rms_norm_eps",
    "norm_epsilon": "rms_norm_eps",
    "add_bias_linear": "attention_bias/mlp_bias",
    "add_qkv_bias": "model_type/attention_bias",
    "qk_layernorm": "model_type",
    "untie_embeddings_and_output_weights": "tie_word_embeddings",
    "rotary_base": "rope_theta",
    "rotary_percent": "partial_rotary_factor",
    "use_rope_scaling": "rope_scaling.rope_type",
    "rope_scaling_factor": "rope_scaling.factor",
    "num_experts": "num_experts",
    "moe_layer_freq": "decoder_sparse_step/mlp_only_layers",
    "moe_ffn_hidden_size": "moe_intermediate_size",
    "moe_router_topk": "num_experts_per_tok",
    "moe_shared_expert_intermediate_size": "shared_expert_intermediate_size",
    "moe_router_score_function": "model_type",
    "moe_router_pre_softmax": "norm_topk_prob",
    "moe_router_topk_scaling_factor": "routed_scaling_factor",
    "rotary_interleaved": "model_type",
    "apply_layernorm_1p": "model_type",
    "post_self_attn_layernorm": "model_type",
    "post_mlp_layernorm": "model_type",
    "attention_output_gate": "model_type",
    "use_gated_attention": "model_type",
    "multi_latent_attention": "kv_lora_rank",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_head_dim": "qk_nope_head_dim",
    "qk_pos_emb_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "mscale": "rope_parameters.mscale",
    "mscale_all_dim": "rope_parameters.mscale_all_dim",
    "rotary_scaling_factor": "rope_parameters.factor (yarn)",
    "moe_router_num_groups": "n_group",
    "moe_router_group_topk": "topk_group",
    "moe_router_enable_expert_bias": "model_type",
    "moe_shared_expert_gate": "model_type",
}


def hf_architecture(config: Any) -> HFArchitecture:
    # a vision-language checkpoint (Qwen3.5's released ones): the flags describe its text model
    config = getattr(config, "text_config", None) or config
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    traits = layer_traits(getattr(config, "model_type", ""))
    attention_bias = bool(getattr(config, "attention_bias", False))
    scaling_kind, factor, theta = rope_scaling(config)
    values = {
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "ffn_hidden_size": getattr(config, "intermediate_size", None),
        "num_attention_heads": heads,
        "group_query_attention": kv != heads,
        "num_query_groups": kv,
        "kv_channels": head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        "swiglu": getattr(config, "hidden_act", None) == "silu",
        "normalization": "RMSNorm" if hasattr(config, "rms_norm_eps") else "LayerNorm",
        "norm_epsilon": getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_eps", None),
        # GLM's attention_bias is on q/k/v only (Megatron-LM: --add-qkv-bias with --disable-bias-linear)
        "add_bias_linear": (attention_bias and not traits.bias_on_qkv_only)
        or bool(getattr(config, "mlp_bias", False)),
        "add_qkv_bias": traits.qkv_bias or attention_bias,
        # q/k norms; DeepSeek-V3's are its latents' (q_a_layernorm, kv_a_layernorm), GLM-4.5's use_qk_norm
        "qk_layernorm": traits.qk_norm
        or bool(getattr(config, "use_qk_norm", False))
        or bool(getattr(config, "kv_lora_rank", None)),
        "untie_embeddings_and_output_weights": not getattr(config, "tie_word_embeddings", False),
        "position_embedding_type": "rope",
        "rotary_base": theta,
        "rotary_percent": partial_rotary(config),
        "use_rope_scaling": scaling_kind == "llama3",
        "rope_scaling_factor": factor,
        **hf_moe(config),
        **_family_values(config),
    }
    keys = dict(HF_KEYS)
    if values["multi_latent_attention"]:
        keys["kv_channels"] = "qk_nope_head_dim"
    if getattr(config, "n_routed_experts", None):
        keys.update(
            num_experts="n_routed_experts",
            moe_layer_freq="first_k_dense_replace/mlp_layer_types",
            moe_shared_expert_intermediate_size="n_shared_experts x moe_intermediate_size",
        )
    return HFArchitecture(values, keys)


def _shared_expert(model_type: str) -> bool:
    """A gated shared expert beside the softmax-routed experts: the registry's families, and
    Qwen2-MoE (not among them, its config read the same way)."""
    return layer_traits(model_type).shared_expert or model_type == "qwen2_moe"


def partial_rotary(config: Any) -> float:
    """The rotated share of each head (rope_parameters in transformers 5, a top-level field before)."""
    params = getattr(config, "rope_parameters", None)
    value = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    return float(value or getattr(config, "partial_rotary_factor", None) or 1.0)


def _family_values(config: Any) -> dict[str, Any]:
    """The layer kinds of the families beyond Qwen/Llama, as Megatron-LM's flags say them."""
    traits = layer_traits(getattr(config, "model_type", ""))
    mla = bool(getattr(config, "kv_lora_rank", None))
    params = getattr(config, "rope_parameters", None) or {}
    yarn = params.get("rope_type") == "yarn"
    return {
        "rotary_interleaved": traits.glm_layers,
        "apply_layernorm_1p": traits.hybrid,
        "post_self_attn_layernorm": traits.glm_layers,
        "post_mlp_layernorm": traits.glm_layers,
        "attention_output_gate": traits.hybrid,
        "use_gated_attention": traits.hybrid,
        "multi_latent_attention": mla,
        **(
            {
                "q_lora_rank": getattr(config, "q_lora_rank", None),
                "kv_lora_rank": config.kv_lora_rank,
                "qk_head_dim": getattr(config, "qk_nope_head_dim", None),
                "qk_pos_emb_head_dim": getattr(config, "qk_rope_head_dim", None),
                "v_head_dim": getattr(config, "v_head_dim", None),
                # Megatron-LM's MLA reads neither: slime's scripts give qk_nope_head_dim
                # (DeepSeek-V3 128, GLM-4.7-Flash 192), and --add-qkv-bias (GLM-4.7-Flash) changes
                # nothing (the latent projections have no bias), so it is not compared
                "kv_channels": getattr(config, "qk_nope_head_dim", None),
                "add_qkv_bias": None,
                "mscale": float(params.get("mscale", 1.0)) if yarn else 1.0,
                "mscale_all_dim": float(params.get("mscale_all_dim", 1.0)) if yarn else 1.0,
                # Megatron-LM's MLA reads --rotary-scaling-factor as YaRN's factor
                "rotary_scaling_factor": float(params.get("factor", 1.0)) if yarn else 1.0,
            }
            if mla
            else {}
        ),
    }


def hf_moe(config: Any) -> dict[str, Any]:
    """An HF config's mixture of experts in Megatron-LM's terms (num_experts 0: dense)."""
    routed = getattr(config, "n_routed_experts", None)  # DeepSeek-V3, GLM-4.5+
    experts = getattr(config, "num_experts", None) or routed or 0
    if not experts:
        return {"num_experts": 0}
    layers = config.num_hidden_layers
    model_type = getattr(config, "model_type", "")
    if routed:
        first_dense = getattr(config, "first_k_dense_replace", 0) or 0
        kinds = getattr(config, "mlp_layer_types", None)  # GLM-4.7-Flash: "dense" / "sparse" per layer
        return {
            "num_experts": experts,
            "moe_layer_freq": [int(k == "sparse") for k in kinds]
            if kinds
            else [int(i >= first_dense) for i in range(layers)],
            "moe_ffn_hidden_size": getattr(config, "moe_intermediate_size", None),
            "moe_router_topk": getattr(config, "num_experts_per_tok", None),
            "moe_shared_expert_intermediate_size": (getattr(config, "n_shared_experts", 0) or 0)
            * (getattr(config, "moe_intermediate_size", 0) or 0),
            "moe_router_score_function": getattr(config, "scoring_func", None)
            or "sigmoid",  # DeepSeek-V2: softmax
            # Megatron-LM's pre-softmax means nothing for sigmoid scores: not compared (None)
            "moe_router_pre_softmax": None,
            "moe_router_topk_scaling_factor": getattr(config, "routed_scaling_factor", None) or 1.0,
            "moe_router_num_groups": getattr(config, "n_group", None),
            "moe_router_group_topk": getattr(config, "topk_group", None),
            "moe_router_enable_expert_bias": layer_traits(model_type).expert_bias,
            "moe_shared_expert_gate": False,
        }
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return {
        "num_experts": experts,
        "moe_layer_freq": [int(i not in dense and (i + 1) % step == 0) for i in range(layers)],
        "moe_ffn_hidden_size": getattr(config, "moe_intermediate_size", None),
        "moe_router_topk": getattr(config, "num_experts_per_tok", None),
        # (Qwen3-MoE's modeling has no shared expert, whatever its config says)
        "moe_shared_expert_intermediate_size": (getattr(config, "shared_expert_intermediate_size", None) or 0)
        if _shared_expert(model_type)
        else 0,
        "moe_router_score_function": "softmax",  # the Qwen MoE families (slime.utils.hf_experts)
        "moe_router_pre_softmax": not _norm_topk(config),
        "moe_router_topk_scaling_factor": getattr(config, "routed_scaling_factor", None) or 1.0,
        "moe_router_enable_expert_bias": False,
        # Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE: a shared expert, where there is one, is gated
        "moe_shared_expert_gate": _shared_expert(model_type)
        and bool(getattr(config, "shared_expert_intermediate_size", None)),
    }


def _norm_topk(config: Any) -> bool:
    """Whether the top-k routing weights are renormalised (Qwen3.5-MoE always does: no field)."""
    norm = getattr(config, "norm_topk_prob", None)
    return (
        bool(norm)
        if norm is not None
        else getattr(config, "model_type", "") in ("qwen3_5_moe", "qwen3_5_moe_text")
    )


def moe_layer_freq(value: Any, num_layers: int) -> list[int] | None:
    """Megatron-LM's --moe-layer-freq as one 0/1 per layer: an int k (every k-th layer, from the
    first) or a list expression such as "[0]*3+[1]*45"; None when it cannot be read."""
    if value is None:
        return [1] * num_layers
    if isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit()):
        k = int(value)
        return [int(i % k == 0) for i in range(num_layers)] if k > 0 else None
    import ast

    try:  # Megatron-LM evaluates the string; only literals and list arithmetic are taken here
        tree = ast.parse(str(value), mode="eval")
        if not all(
            isinstance(n, (ast.Expression, ast.List, ast.Constant, ast.BinOp, ast.Add, ast.Mult, ast.Load))
            for n in ast.walk(tree)
        ):
            return None
        freq = eval(compile(tree, "<--moe-layer-freq>", "eval"), {"__builtins__": {}})
    except (SyntaxError, ValueError, TypeError):
        return None
    return [int(x) for x in freq] if isinstance(freq, list) else None


def _megatron_moe(ns: argparse.Namespace) -> dict[str, Any]:
    if not ns.num_experts:
        return {"num_experts": 0} if model_described(ns) else {}
    out: dict[str, Any] = {"num_experts": ns.num_experts}
    out["moe_router_topk"] = 2 if ns.moe_router_topk is None else ns.moe_router_topk
    out["moe_router_pre_softmax"] = bool(ns.moe_router_pre_softmax)
    out["moe_shared_expert_intermediate_size"] = ns.moe_shared_expert_intermediate_size or 0
    out["moe_router_score_function"] = ns.moe_router_score_function or "softmax"
    out["moe_router_topk_scaling_factor"] = ns.moe_router_topk_scaling_factor or 1.0
    out["moe_router_enable_expert_bias"] = bool(ns.moe_router_enable_expert_bias)
    out["moe_shared_expert_gate"] = bool(ns.moe_shared_expert_gate)
    for dest in ("moe_router_num_groups", "moe_router_group_topk"):
        if getattr(ns, dest) is not None:
            out[dest] = getattr(ns, dest)
    ffn = ns.moe_ffn_hidden_size if ns.moe_ffn_hidden_size is not None else ns.ffn_hidden_size
    if ffn is not None:
        out["moe_ffn_hidden_size"] = ffn
    if ns.num_layers is not None:
        out["moe_layer_freq"] = moe_layer_freq(ns.moe_layer_freq, ns.num_layers) or ns.moe_layer_freq
    return out


def megatron_architecture(ns: argparse.Namespace) -> dict[str, Any]:
    """The model the flags describe, in Megatron-LM's meaning (its defaults for what is absent).
    Only keys with a definite value are returned: a size not given is not compared."""
    out: dict[str, Any] = _megatron_moe(ns)
    for dest in (
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "vocab_size",
        "max_position_embeddings",
        "kv_channels",
    ):
        if getattr(ns, dest) is not None:
            out[dest] = getattr(ns, dest)
    if ns.num_attention_heads is not None:
        gqa = bool(ns.group_query_attention)
        out["group_query_attention"] = gqa
        if gqa and ns.num_query_groups is not None:
            out["num_query_groups"] = ns.num_query_groups
        elif not gqa:
            out["num_query_groups"] = ns.num_attention_heads  # Megatron-LM: MHA without the flag
    if ns.multi_latent_attention and ns.rotary_scaling_factor is not None and not ns.use_rope_scaling:
        out["rotary_scaling_factor"] = ns.rotary_scaling_factor  # YaRN's factor (multi-latent attention)
    if not model_described(ns):
        # Only what was given: the booleans' defaults mean something only for a whole model.
        for dest in ("norm_epsilon", "rotary_base", "rotary_percent"):
            if getattr(ns, dest) is not None:
                out[dest] = getattr(ns, dest)
        out.update({dest: True for dest in _FAMILY_BOOLEANS if getattr(ns, dest)})
        return out
    out["swiglu"] = bool(ns.swiglu)
    out["normalization"] = ns.normalization or "LayerNorm"
    out["norm_epsilon"] = 1e-5 if ns.norm_epsilon is None else ns.norm_epsilon
    out["add_bias_linear"] = not ns.disable_bias_linear
    out["add_qkv_bias"] = bool(ns.add_qkv_bias) or not ns.disable_bias_linear
    out["qk_layernorm"] = bool(ns.qk_layernorm)
    out["untie_embeddings_and_output_weights"] = bool(ns.untie_embeddings_and_output_weights)
    rope = ns.use_rotary_position_embeddings or ns.position_embedding_type == "rope"
    out["position_embedding_type"] = "rope" if rope else ns.position_embedding_type or "learned_absolute"
    out["rotary_base"] = 10000.0 if ns.rotary_base is None else ns.rotary_base
    out["rotary_percent"] = 1.0 if ns.rotary_percent is None else ns.rotary_percent
    for dest in _FAMILY_BOOLEANS:
        out[dest] = bool(getattr(ns, dest))
    for dest in (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_head_dim",
        "qk_pos_emb_head_dim",
        "v_head_dim",
        "mscale",
        "mscale_all_dim",
    ):
        if getattr(ns, dest) is not None:
            out[dest] = getattr(ns, dest)
    out["use_rope_scaling"] = bool(ns.use_rope_scaling)
    if ns.use_rope_scaling:
        out["rope_scaling_factor"] = next(
            (v for v in (ns.rope_scaling_factor, ns.rotary_scaling_factor) if v is not None), 8.0
        )
    return out


_FAMILY_BOOLEANS = (
    "rotary_interleaved",
    "apply_layernorm_1p",
    "post_self_attn_layernorm",
    "post_mlp_layernorm",
    "attention_output_gate",
    "use_gated_attention",
    "multi_latent_attention",
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=1e-6)
    return a == b


def _flag_text(dest: str, value: Any, ns: argparse.Namespace) -> str:
    """How the flags said it, for a message."""
    booleans = {
        "swiglu": "--swiglu",
        "add_qkv_bias": "--add-qkv-bias",
        "qk_layernorm": "--qk-layernorm",
        "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
        "group_query_attention": "--group-query-attention",
        "use_rope_scaling": "--use-rope-scaling",
        "add_bias_linear": "--disable-bias-linear",
        **{
            d: "--" + d.replace("_", "-")
            for d in (*_FAMILY_BOOLEANS, "moe_router_enable_expert_bias", "moe_shared_expert_gate")
        },
    }
    if dest == "add_bias_linear":
        return "no --disable-bias-linear (biases on)" if value else "--disable-bias-linear"
    if dest in booleans:
        return booleans[dest] if value else f"no {booleans[dest]} (Megatron-LM's default: off)"
    if dest == "num_query_groups" and not ns.group_query_attention:
        return f"no --group-query-attention (one key/value head per query head: {value})"
    if dest == "position_embedding_type":
        return f"--position-embedding-type {value}" + (" (Megatron-LM's default)" if value != "rope" else "")
    if dest == "rope_scaling_factor":
        given = "--rope-scaling-factor" if ns.rope_scaling_factor is not None else "--rotary-scaling-factor"
        return f"{given} {value}"
    flag = "--" + dest.replace("_", "-")
    if getattr(ns, dest, None) is None:
        return f"{flag} {value} (Megatron-LM's default)"
    return f"{flag} {value}"


def architecture_problems(ns: argparse.Namespace, config: Any, where: str) -> list[str]:
    """Every architecture flag (or Megatron-LM default, for a described model) that disagrees
    with the HF config, one message each naming the flag, its value, the config key and its value."""
    hf = hf_architecture(config)
    out = []
    for dest, value in megatron_architecture(ns).items():
        theirs = hf.values.get(dest)
        if theirs is None or _same(value, theirs):
            continue
        key = hf.keys.get(dest, dest)
        shown = theirs
        if dest == "swiglu":
            shown = getattr(config, "hidden_act", None)
        elif dest == "untie_embeddings_and_output_weights":
            shown = getattr(config, "tie_word_embeddings", False)
        elif dest == "use_rope_scaling":
            shown = rope_scaling(config)[0]
        elif dest in ("qk_layernorm", "add_qkv_bias"):
            shown = (
                f"{getattr(config, 'model_type', '?')} "
                f"(attention_bias={getattr(config, 'attention_bias', None)})"
            )
        elif dest == "multi_latent_attention":
            shown = getattr(config, "kv_lora_rank", None)
        elif key == "model_type":
            shown = getattr(config, "model_type", "?")
        out.append(f"{_flag_text(dest, value, ns)} disagrees with {where}: config.json {key} = {shown}")
    limit = hf.values["max_position_embeddings"]
    if ns.seq_length is not None and limit is not None and ns.seq_length > limit:
        out.append(f"--seq-length {ns.seq_length} is longer than {where}'s max_position_embeddings {limit}")
    if (
        ns.rotary_scaling_factor not in (None, 1.0)
        and not ns.use_rope_scaling
        and not ns.multi_latent_attention
    ):
        out.append(
            f"--rotary-scaling-factor {ns.rotary_scaling_factor} without --use-rope-scaling: scaled RoPE "
            "other than Llama 3's, and YaRN with --multi-latent-attention, is not supported"
        )
    return out


def hf_config(path: str | None) -> Any:
    """--hf-checkpoint's config, or None where it cannot be read here: a missing or bad checkpoint is reported
    by the input checks, with the reason."""
    if not path or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(path)
    except Exception:  # transformers raises many types for bad configs
        return None
