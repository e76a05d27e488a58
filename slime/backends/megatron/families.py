"""What the Megatron backend reads of each family's HF config (slime.backends.megatron.convert's
Layout is built from it): the families it builds (`SUPPORTED`), their rotary settings, multi-latent
attention, the gated delta-net layer mix and the experts, each refused by name where megatron-core
would compute otherwise than transformers. Pure config code: no megatron-core import.
"""

from __future__ import annotations

from typing import Any

from slime.utils.model_families import FAMILIES, Family


class ConversionError(ValueError):
    """A checkpoint or config that cannot be converted (names what and why)."""


def rope_theta(config: Any) -> float:
    """The rotary base of an HF config. Plain RoPE, and YaRN for multi-latent attention (which
    megatron-core's MLA builds: `mla_yarn`); other scaled variants (llama3, yarn on GQA, ...)
    would give megatron-core other positions than the engine, so they are refused."""
    from slime.config.architecture import rope_scaling

    kind, _, theta = rope_scaling(config)
    if kind == "yarn" and getattr(config, "kv_lora_rank", None):
        mla_yarn(config)  # refuses a YaRN variant megatron-core computes otherwise
    elif kind != "default":
        raise ConversionError(
            f"rope_type {kind!r}: the Megatron backend builds plain RoPE, and YaRN with multi-latent "
            "attention only (the config's rope scaling is not converted)"
        )
    return theta


def mla_yarn(config: Any) -> dict[str, Any]:
    """megatron-core's YaRN settings for a multi-latent-attention config whose rope_type is yarn
    (DeepSeek-V3, Kimi-K2): the same frequencies, rotary magnitude (attention_factor) and softmax
    scale as transformers computes. The variants where the two would differ are refused."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    original = params.get("original_max_position_embeddings")
    if not original:
        raise ConversionError("rope_type 'yarn' without original_max_position_embeddings: not converted")
    factor = params.get("factor") or config.max_position_embeddings / original
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if params.get("attention_factor") is not None or params.get("truncate", True) is not True:
        raise ConversionError(
            "YaRN with attention_factor or truncate false: megatron-core computes it otherwise"
        )
    if bool(mscale) != bool(mscale_all_dim) and mscale_all_dim:
        # transformers then scales the rotary part by get_mscale(factor) but the softmax by
        # mscale_all_dim; megatron-core scales both from mscale / mscale_all_dim
        raise ConversionError("YaRN with mscale_all_dim but no mscale: megatron-core computes it otherwise")
    both = bool(mscale and mscale_all_dim)
    return {
        "rope_type": "yarn",
        "rotary_scaling_factor": float(factor),
        "original_max_position_embeddings": int(original),
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        # without both, transformers' rotary magnitude is get_mscale(factor): megatron-core's with 1 / 0
        "mscale": float(mscale or 1.0) if both else 1.0,
        "mscale_all_dim": float(mscale_all_dim or 0.0) if both else 0.0,
    }


SUPPORTED: dict[str, Family] = {t: f for t, f in FAMILIES.items() if f.megatron is None}
"""The model_types the Megatron backend builds; what their layers have beyond Llama's is the
registry's (slime.utils.model_families: qkv_bias, qk_norm, output_bias, glm_layers, hybrid)."""


def mla_fields(config: Any, bias: bool) -> dict[str, Any]:
    """The attention fields of a multi-latent-attention (DeepSeek-V3) config."""
    if bias:
        raise ConversionError(
            "multi-latent attention with attention_bias: the projections' biases are not converted"
        )
    if getattr(config, "rope_interleave", True) is not True:
        raise ConversionError(
            "multi-latent attention with rope_interleave false: megatron-core's MLA rotates interleaved "
            "pairs (DeepSeek-V3's layout), so this config is not converted"
        )
    return {
        "num_query_groups": config.num_attention_heads,  # every head reads the one latent
        "head_dim": config.qk_nope_head_dim,
        "kv_lora_rank": config.kv_lora_rank,
        "q_lora_rank": getattr(config, "q_lora_rank", None) or 0,
        "qk_rope_head_dim": config.qk_rope_head_dim,
        "v_head_dim": config.v_head_dim,
    }


def hybrid_fields(config: Any) -> dict[str, Any]:
    """The layer mix of a gated delta-net family (Qwen3-Next, Qwen3.5): which layers are linear
    attention, the delta-net's shape, gated full attention and zero-centred norms."""
    kinds = list(getattr(config, "layer_types", None) or [])
    if len(kinds) != config.num_hidden_layers or set(kinds) - {"linear_attention", "full_attention"}:
        raise ConversionError(
            f"layer_types {kinds!r}: one of linear_attention / full_attention per layer is needed"
        )
    return {
        "linear_layers": tuple(int(k == "linear_attention") for k in kinds),
        "linear_shape": (
            config.linear_num_key_heads,
            config.linear_num_value_heads,
            config.linear_key_head_dim,
            config.linear_value_head_dim,
            config.linear_conv_kernel_dim,
        ),
        "linear_split_proj": config.model_type != "qwen3_next",
        "gated_attention": True,
        "zero_centered_norm": True,
    }


def moe_fields(config: Any) -> dict[str, Any]:
    """The MoE fields of a Layout (none for a dense config). Routing that megatron-core's router
    would compute otherwise than the HF model is refused, with what differs."""
    from slime.config.architecture import hf_moe

    moe = hf_moe(config)
    if not moe["num_experts"]:
        return {}
    topk = moe["moe_router_topk"]
    groups, group_topk = moe.get("moe_router_num_groups") or 1, moe.get("moe_router_group_topk") or 1
    if moe["moe_router_score_function"] == "sigmoid":
        norm = bool(getattr(config, "norm_topk_prob", True))
        if topk > 1 and not norm:
            raise ConversionError(
                "sigmoid routing without norm_topk_prob: megatron-core always renormalises the top-k "
                "sigmoid scores"
            )
        if topk == 1 and norm:
            raise ConversionError(
                "sigmoid routing to one expert with norm_topk_prob: transformers weighs it 1, "
                "megatron-core by its sigmoid score"
            )
    elif moe["moe_router_topk_scaling_factor"] != 1.0:
        raise ConversionError("a routed scaling factor other than 1 with softmax routing is not converted")
    if groups > 1 and topk // group_topk != 2:
        raise ConversionError(
            f"n_group {groups} with num_experts_per_tok {topk} and topk_group {group_topk}: the HF model "
            "scores each group by its best 2 experts, megatron-core by its best num_experts_per_tok / "
            f"topk_group = {topk // group_topk}; not converted"
        )
    return {
        "num_experts": moe["num_experts"],
        "moe_ffn_hidden_size": moe["moe_ffn_hidden_size"],
        "moe_layers": tuple(moe["moe_layer_freq"]),
        "shared_ffn_hidden_size": moe["moe_shared_expert_intermediate_size"] or 0,
        "expert_bias": bool(moe["moe_router_enable_expert_bias"]),
        "shared_expert_gate": bool(moe.get("moe_shared_expert_gate")),
        # the Qwen families name their one shared expert in the singular
        "shared_expert_name": "shared_experts"
        if getattr(config, "n_routed_experts", None)
        else "shared_expert",
    }
