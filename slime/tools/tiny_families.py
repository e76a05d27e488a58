"""The configs of `make_tiny_model --arch` for the families beyond Qwen2/Qwen3: each the family's
own transformers config class with the fields its released checkpoints set, at a tiny size.

- glm4 (GLM-4-0414): half the head dim rotated (partial_rotary_factor 0.5), q/k/v bias,
  sandwich norms (after attention and after the MLP), untied output layer.
- glm4_moe (GLM-4.5 / 4.6 / 4.7): GLM-4's partial rotary and attention; routed experts with
  sigmoid scores and a per-expert correction bias (aux-loss-free balancing), a shared expert,
  the first layer dense, routed weights scaled by routed_scaling_factor.
- deepseek_v3 (DeepSeek-V3 / R1, Kimi-K2, Moonlight): multi-latent attention (queries through a
  low-rank q_lora_rank, keys and values from one compressed kv_lora_rank latent, a separate
  rotary part of qk_rope_head_dim, interleaved), routing over expert groups (n_group, of which
  topk_group are kept) with sigmoid scores and the correction bias, a shared expert, the first
  layer dense.
- glm4_moe_lite (GLM-4.7-Flash): DeepSeek-V3's multi-latent attention with GLM-4.5's experts
  (sigmoid scores with the correction bias, a shared expert, the first layer dense by
  `mlp_layer_types`).
- qwen3_next (Qwen3-Next): gated delta-net linear-attention layers with gated full attention
  every full_attention_interval-th layer, zero-centred norms (1 + gamma), partial rotary; every
  MLP routed experts plus a gated shared expert.
- qwen3_5 / qwen3_5_moe (Qwen3.5 text): Qwen3-Next's layer mix, dense or with experts.

transformers' defaults fill the fields not named here. `num_nextn_predict_layers` (MTP) is 0
unless `--mtp-layers N` asks for N (the MTP_FAMILIES): transformers has no MTP modules (it skips
their tensors on load), so `mtp_tensors` writes them as the released checkpoints store them.
"""

from __future__ import annotations

import argparse
from typing import Any

MOE_FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v3", "glm4_moe_lite", "qwen3_next", "qwen3_5_moe")
NEW_FAMILIES = ("glm4", "glm4_moe", "deepseek_v3", "glm4_moe_lite", "qwen3_next", "qwen3_5", "qwen3_5_moe")
MTP_FAMILIES = ("glm4_moe", "deepseek_v3", "glm4_moe_lite")
"""Families whose released checkpoints carry multi-token prediction modules as extra decoder
layers (`model.layers.{num_hidden_layers + k}.*`: DeepSeek-V3's layer 61, GLM-4.5's 92)."""


def family_config(args: argparse.Namespace, common: dict[str, Any], arch: str | None = None) -> Any:
    """The config of `arch` (default `args.arch`; one of NEW_FAMILIES) with the `common` size fields."""
    arch = arch or args.arch
    head_dim = args.hidden_size // args.num_heads
    common = {**common, "tie_word_embeddings": False}  # every one of these families unties
    # Fields some config classes take through **kwargs (so typed loosely here): head_dim where it
    # is not declared, MTP's layer count; and the partial rotary factor, in rope_parameters.
    loose: dict[str, Any] = {
        "head_dim": head_dim,
        "num_nextn_predict_layers": getattr(args, "mtp_layers", 0) or 0,
    }
    moe: dict[str, Any] = {}
    if arch in MOE_FAMILIES:
        moe = dict(
            num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=args.moe_intermediate_size or args.hidden_size // 2,
        )
    if arch in ("glm4", "glm4_moe"):
        return _glm_config(arch, args, head_dim, loose, moe, common)
    if arch in ("deepseek_v3", "glm4_moe_lite"):
        return _latent_attention_config(arch, args, head_dim, loose, moe, common)
    if arch in ("qwen3_next", "qwen3_5", "qwen3_5_moe"):
        return _hybrid_config(arch, args, head_dim, moe, common)
    raise ValueError(f"unknown --arch {arch!r}")


def _glm_config(
    arch: str,
    args: argparse.Namespace,
    head_dim: int,
    loose: dict[str, Any],
    moe: dict[str, Any],
    common: dict[str, Any],
) -> Any:
    """GLM-4 and GLM-4.5: half-rotary attention with q/k/v biases."""
    import transformers

    glm_rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    if arch == "glm4":
        return transformers.Glm4Config(
            head_dim=head_dim, attention_bias=True, rope_parameters=glm_rope, **common
        )
    return transformers.Glm4MoeConfig(
        attention_bias=True,
        rope_parameters=glm_rope,
        n_routed_experts=args.num_experts,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
        **loose,
        **moe,
        **common,
    )


def _latent_attention_config(
    arch: str,
    args: argparse.Namespace,
    head_dim: int,
    loose: dict[str, Any],
    moe: dict[str, Any],
    common: dict[str, Any],
) -> Any:
    """DeepSeek-V3 and GLM-4.7-Flash: multi-latent attention, every head reading the latent."""
    import transformers

    rope = max(2, head_dim // 2)
    common = {**common, "num_key_value_heads": args.num_heads}
    latent = dict(
        q_lora_rank=args.hidden_size // 2,
        kv_lora_rank=args.hidden_size // 4,
        qk_nope_head_dim=head_dim,
        qk_rope_head_dim=rope,
        rope_interleave=True,
        n_routed_experts=args.num_experts,
        n_shared_experts=1,
        topk_group=1,
        norm_topk_prob=True,
    )
    if arch == "deepseek_v3":
        loose = {**loose, "head_dim": rope}  # transformers rotates head_dim channels: the rotary part's width
        return transformers.DeepseekV3Config(
            v_head_dim=head_dim,
            first_k_dense_replace=1,
            n_group=2 if args.num_experts % 2 == 0 else 1,
            routed_scaling_factor=2.5,
            **latent,
            **loose,
            **moe,
            **common,
        )
    loose = {
        k: v for k, v in loose.items() if k != "head_dim"
    }  # the config maps head_dim to qk_rope_head_dim
    return transformers.Glm4MoeLiteConfig(
        # values wider than the keys' non-rotary part, as GLM-4.7-Flash's (256 against 192)
        v_head_dim=head_dim + head_dim // 2,
        n_group=1,
        routed_scaling_factor=1.8,
        **latent,
        **loose,
        **moe,
        **common,
    )


def _hybrid_config(
    arch: str, args: argparse.Namespace, head_dim: int, moe: dict[str, Any], common: dict[str, Any]
) -> Any:
    """Qwen3-Next and Qwen3.5: gated delta-net layers, full attention every second layer."""
    import transformers

    linear: dict[str, Any] = dict(
        head_dim=head_dim,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=head_dim,
        linear_value_head_dim=head_dim,
        linear_num_key_heads=max(1, args.num_kv_heads),
        linear_num_value_heads=args.num_heads,
        full_attention_interval=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    experts = dict(num_experts=args.num_experts, shared_expert_intermediate_size=args.hidden_size // 2)
    if arch == "qwen3_next":
        return transformers.Qwen3NextConfig(
            decoder_sparse_step=1,
            norm_topk_prob=True,
            mlp_only_layers=[],
            **linear,
            **experts,
            **moe,
            **common,
        )
    if arch == "qwen3_5":
        return transformers.Qwen3_5TextConfig(**linear, **common)
    return transformers.Qwen3_5MoeTextConfig(**linear, **experts, **moe, **common)


def seed_family_state(model: Any, seed: int) -> None:
    """State a released checkpoint has and a fresh model lacks: the expert-score correction bias
    (zeros at init) set to small seeded values, as aux-loss-free balancing leaves it, so a loader
    that drops it changes the routing and fails the tests."""
    import torch

    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.05 * torch.randn(buf.shape, generator=g))


def mtp_tensors(model: Any, n: int, seed: int) -> dict[str, Any]:
    """The tensors of `n` MTP modules after `model`'s decoder, named as DeepSeek-V3's and GLM-4.5's
    checkpoints name them: module k is HF layer L + k (L decoder layers), a decoder layer shaped as
    the last one (self_attn, mlp with its experts, the two norms; written by transformers' own
    serialization of a model n layers deeper, seeded) beside `enorm`, `hnorm`, `eh_proj`
    ([hidden, 2 x hidden]: the next token's normed embedding, then the normed hidden state),
    `shared_head.norm`, and copies of the model's embedding and head (`embed_tokens`,
    `shared_head.head`). Norm weights are 1 + N(0, 0.1) (distinct, so a misplaced norm shows)."""
    import copy
    import tempfile

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    layers = config.num_hidden_layers
    config.num_hidden_layers = layers + n
    if getattr(config, "mlp_layer_types", None):  # GLM-4.7-Flash: the MTP layers route to experts
        config.mlp_layer_types = list(config.mlp_layer_types) + ["sparse"] * n
    torch.manual_seed(seed + 11)
    deeper = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    seed_family_state(deeper, seed + 11)
    with tempfile.TemporaryDirectory() as tmp:
        deeper.save_pretrained(tmp, safe_serialization=True)
        saved = load_file(f"{tmp}/model.safetensors")
    g = torch.Generator().manual_seed(seed + 13)
    h = config.hidden_size
    out: dict[str, Any] = {}
    for k in range(n):
        prefix = f"model.layers.{layers + k}."
        for name, t in saved.items():
            if name.startswith(prefix):
                out[name] = 1 + 0.1 * torch.randn(t.shape, generator=g) if name.endswith("norm.weight") else t
        for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
            out[prefix + name] = 1 + 0.1 * torch.randn(h, generator=g)
        std = float(getattr(config, "initializer_range", 0.02))
        out[prefix + "eh_proj.weight"] = std * torch.randn(h, 2 * h, generator=g)
        out[prefix + "embed_tokens.weight"] = model.get_input_embeddings().weight.detach().clone()
        out[prefix + "shared_head.head.weight"] = model.get_output_embeddings().weight.detach().clone()
    return out
