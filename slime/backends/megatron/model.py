"""A megatron-core GPTModel for an HF config (Qwen2 / Qwen3 / Llama), imported lazily.

`build_gpt_model` needs megatron-core's parallel state initialised (TP / PP / CP / EP groups);
it builds this rank's part: its TP shard of every layer, and only its pipeline stage's layers,
with the embedding on the first stage and the output layer on the last. The layer spec is
megatron-core's local one (its core attention extended to packed sequences:
slime.backends.megatron.attention), or Transformer Engine's when `transformer_impl` asks for it
(then the input and pre-MLP norms are folded into linear_qkv / linear_fc1, as `Layout.fold_norms`
says).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from slime.backends.megatron.convert import Layout, rope_theta


def moe_settings(layout: Layout, hf_config: Any, router_dtype: str | None = None) -> dict[str, Any]:
    """megatron-core's MoE settings for a mixture-of-experts layout (none for a dense one). The
    load-balancing loss is slime's (slime.backends.megatron.moe), so megatron-core's is off; the
    all-to-all dispatcher is the one megatron-core runs with variable-length micro-batches."""
    if not layout.num_experts:
        return {}
    from slime.config.architecture import hf_moe

    moe = hf_moe(hf_config)
    groups = moe.get("moe_router_num_groups") or 1
    return {
        "num_moe_experts": layout.num_experts,
        "moe_ffn_hidden_size": layout.moe_ffn_hidden_size,
        "moe_layer_freq": list(layout.moe_layers),
        "moe_router_topk": moe["moe_router_topk"],
        "moe_router_pre_softmax": bool(moe["moe_router_pre_softmax"]),
        "moe_router_score_function": moe["moe_router_score_function"],
        "moe_router_topk_scaling_factor": moe["moe_router_topk_scaling_factor"],
        # grouped top-k (DeepSeek-V3): one group is no grouping
        **(
            {"moe_router_num_groups": groups, "moe_router_group_topk": moe["moe_router_group_topk"]}
            if groups > 1
            else {}
        ),
        # aux-loss-free routing: the checkpoint's expert bias; the actor moves it itself after each
        # step (--moe-router-bias-update-rate): megatron-core's finalize_model_grads never runs here
        "moe_router_enable_expert_bias": layout.expert_bias,
        "moe_router_bias_update_rate": 0.0,
        "moe_shared_expert_intermediate_size": layout.shared_ffn_hidden_size or None,
        "moe_shared_expert_gate": layout.shared_expert_gate,
        "moe_router_dtype": router_dtype,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_grouped_gemm": layout.grouped_experts,
        "moe_token_dispatcher_type": "alltoall",
        "moe_permute_fusion": False,
    }


def mla_settings(layout: Layout, hf_config: Any) -> dict[str, Any]:
    """megatron-core's multi-latent-attention settings: plain RoPE or YaRN on the rotary part
    (convert.mla_yarn), the softmax scale 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim) (times
    YaRN's mscale_all_dim correction), as transformers computes them."""
    if not layout.kv_lora_rank:
        return {}
    from slime.backends.megatron.convert import mla_yarn
    from slime.config.architecture import rope_scaling

    plain = {"rope_type": "rope", "rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
    return {
        **layout.mla_args(),
        "rotary_base": rope_theta(hf_config),
        **(mla_yarn(hf_config) if rope_scaling(hf_config)[0] == "yarn" else plain),
    }


def transformer_config(
    layout: Layout,
    hf_config: Any,
    params_dtype: torch.dtype = torch.float32,
    cpu_init: bool = False,
    router_dtype: str | None = None,
    **parallel: Any,
) -> Any:
    """megatron-core's TransformerConfig for the layout (plus TP/PP/CP/EP sizes in `parallel`);
    its MLATransformerConfig for multi-latent attention."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    if router_dtype is None and layout.num_experts:
        from slime.utils.model_families import family

        f = family(layout.model_type)
        router_dtype = "fp32" if f is not None and f.router_fp32 else None  # as transformers routes them
    mla = mla_settings(layout, hf_config)
    return (MLATransformerConfig if mla else TransformerConfig)(
        num_layers=layout.num_layers,
        hidden_size=layout.hidden_size,
        ffn_hidden_size=layout.ffn_hidden_size,
        num_attention_heads=layout.num_heads,
        num_query_groups=layout.num_query_groups,
        kv_channels=layout.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=float(getattr(hf_config, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=layout.qkv_bias,
        qk_layernorm=layout.qk_norm,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        use_cpu_initialization=cpu_init,
        # Kernels that need CUDA or Apex: off (the local spec runs plain torch).
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        rotary_interleaved=layout.rotary_interleaved,
        # Qwen3-Next / Qwen3.5: gated full attention, zero-centred norms
        attention_output_gate=layout.gated_attention,
        layernorm_zero_centered_gamma=layout.zero_centered_norm,
        **{
            **mla,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            **moe_settings(layout, hf_config, router_dtype),
            # uneven pipeline stages (megatron-core splits the rest as Layout.stages does)
            **(
                {"num_layers_in_first_pipeline_stage": layout.first_stage_layers}
                if layout.first_stage_layers is not None
                else {}
            ),
            **(
                {"num_layers_in_last_pipeline_stage": layout.last_stage_layers}
                if layout.last_stage_layers is not None
                else {}
            ),
            # multi-token prediction modules (slime.backends.megatron.mtp weighs their loss itself)
            **({"mtp_num_layers": layout.mtp_layers} if layout.mtp_layers else {}),
            **parallel,
        },
    )


def layer_spec(layout: Layout, moe: bool = False, linear: Any = None) -> Any:
    """One layer's spec: dense, or (`moe`) with megatron-core's MoE layer (SequentialMLP, or
    TEGroupedMLP with `layout.grouped_experts`); multi-latent attention where the layout has it,
    GLM-4's sandwich norms where it has them (SandwichNormLayer); with `linear` (the HF config of
    a Qwen3-Next / Qwen3.5 model) a gated delta-net in the attention slot (LinearAttention)."""
    experts = {"num_experts": layout.num_experts, "moe_grouped_gemm": layout.grouped_experts} if moe else {}
    mla = bool(layout.kv_lora_rank)
    if layout.fold_norms:
        if layout.post_norms:
            raise NotImplementedError("GLM-4's sandwich norms are built with the local layer spec only")
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        spec = get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=layout.qk_norm or mla, multi_latent_attention=mla, **experts
        )
        return _with_linear_attention(spec, linear) if linear is not None else spec
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from slime.backends.megatron.attention import LatentCoreAttention, SegmentDotProductAttention

    spec = get_gpt_layer_local_spec(
        qk_layernorm=layout.qk_norm or mla, multi_latent_attention=mla, normalization="RMSNorm", **experts
    )
    # megatron-core's local attention, plus packed sequences (slime.backends.megatron.attention);
    # for MLA's narrower values, torch's attention
    spec.submodules.self_attention.submodules.core_attention = (
        LatentCoreAttention if mla else SegmentDotProductAttention
    )
    if layout.post_norms:
        from slime.backends.megatron.layers import SandwichNormLayer

        spec.module = SandwichNormLayer
    if layout.zero_centered_norm:  # megatron-core's torch norms refuse zero-centred weights
        from slime.backends.megatron.layers import ZeroCenteredRMSNorm

        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = ZeroCenteredRMSNorm
        attention = spec.submodules.self_attention.submodules
        attention.q_layernorm = attention.k_layernorm = ZeroCenteredRMSNorm
    return _with_linear_attention(spec, linear) if linear is not None else spec


def _with_linear_attention(spec: Any, hf_config: Any) -> Any:
    """`spec` with the gated delta-net in its attention slot (its input norm inside it)."""
    import copy

    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec

    from slime.backends.megatron.linear_attention import LinearAttention

    spec = copy.deepcopy(spec)
    spec.submodules.self_attention = ModuleSpec(module=LinearAttention, params={"hf_config": hf_config})
    spec.submodules.input_layernorm = IdentityOp
    return spec


def block_spec(layout: Layout, pp: int, pp_rank: int, hf_config: Any = None) -> Any:
    """A dense model's layer spec, or for a MoE or hybrid model the stage's layers one by one (MoE
    layers where `layout.moe_layers` says, dense ones elsewhere; gated delta-nets where
    `layout.linear_layers` says, from `hf_config`)."""
    if not layout.num_experts and not layout.linear_layers:
        return layer_spec(layout)
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    final_norm: Any = LayerNormImpl
    if layout.zero_centered_norm and not layout.fold_norms:
        from slime.backends.megatron.layers import ZeroCenteredRMSNorm

        final_norm = ZeroCenteredRMSNorm
    specs = {}
    for moe, linear in itertools.product((False, True), (False, True)):
        if (moe and not layout.num_experts) or (linear and not layout.linear_layers):
            continue
        specs[moe, linear] = layer_spec(layout, moe, hf_config if linear else None)
    layers = layout.stages(pp)[pp_rank]
    return TransformerBlockSubmodules(
        layer_specs=[specs[layout.is_moe(i), layout.is_linear(i)] for i in layers], layer_norm=final_norm
    )


def build_gpt_model(layout: Layout, hf_config: Any, config: Any, tp: int) -> Any:
    """This rank's GPTModel (its pipeline stage from megatron-core's parallel state); with MTP
    modules, slime.backends.megatron.mtp's, the modules on the last stage."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    without_transformer_engine()
    pp, pp_rank = (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    spec = block_spec(layout, pp, pp_rank, hf_config)
    mtp: dict[str, Any] = {}
    cls = GPTModel
    if layout.mtp_layers and parallel_state.is_pipeline_last_stage():  # megatron-core: MTP on the last stage
        from slime.backends.megatron.mtp import mtp_block_spec, mtp_model_class

        cls = mtp_model_class()
        mtp["mtp_block_spec"] = mtp_block_spec(config, spec, layout.fold_norms)
    return cls(
        config,
        spec,
        vocab_size=layout.padded_vocab_size(tp),
        max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=layout.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
        rotary_percent=layout.rotary_percent,
        **mtp,
    )


def without_transformer_engine() -> None:
    """Two places where megatron-core 0.16 runs only with Transformer Engine installed, though
    each has a fallback for its absence:

    - its router reads the module global `te_general_gemm`, which moe_utils defines only when TE
      imports: without TE every MoE forward stops with a NameError. Its own fallback (a torch
      matmul in the router's dtype) is taken when the name is None, so define it as None;
    - multi_latent_attention decides TE is there when megatron-core's TE extension module
      imports, which it does without TE (its classes are then None), and then calls
      `isinstance(..., None)`: set its HAVE_TE to what is true.

    Both on any device, only where TE is absent; and, with or without TE, megatron-core's count
    for the expert-bias update is made to take a padding mask (expert_bias_counts_without_padding)."""
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]
    if not isinstance(getattr(multi_latent_attention, "TELinear", None), type):
        multi_latent_attention.HAVE_TE = False
    expert_bias_counts_without_padding()


def expert_bias_counts_without_padding() -> None:
    """megatron-core 0.16's router counts each expert's tokens for the expert-bias update
    (`_apply_expert_bias`) as `routing_map & ~padding_mask`, with routing_map [tokens, experts]
    and the padding mask [tokens] (flattened sequence-major, as the logits): any padding mask
    stops it with a size error. The mask gets its experts axis ([tokens, 1]) before
    megatron-core's own count runs."""
    from megatron.core.transformer.moe.router import TopKRouter

    original = TopKRouter._apply_expert_bias
    if getattr(original, "_slime_flattens_mask", False):
        return

    def apply_expert_bias(
        self: Any, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None
    ) -> Any:
        if padding_mask is not None and padding_mask.dim() == 1:
            padding_mask = padding_mask.unsqueeze(-1)
        return original(self, routing_map, padding_mask=padding_mask)

    apply_expert_bias._slime_flattens_mask = True  # type: ignore[attr-defined]
    TopKRouter._apply_expert_bias = apply_expert_bias  # type: ignore[method-assign]


def model_state(model: Any) -> dict[str, torch.Tensor]:
    """The tensors of a GPTModel's state dict (megatron-core's `_extra_state` entries left out)."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}


def move_rotary_tables(model: Any, device: str | torch.device) -> None:
    """Move what megatron-core's rotary embedding keeps outside the module's parameters and
    buffers, which `model.to` misses: its `inv_freq` (a plain attribute, made on the GPU) and
    the tables its `forward` caches per sequence length (a class-wide lru_cache, emptied:
    computed again on use). Found by the first GPU run: 31,232 B left on the device after sleep."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    # (YaRN's, for multi-latent attention, keeps two more frequency tensors and its own cache)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            for name in ("inv_freq", "inv_freq_extra", "inv_freq_inter"):
                if isinstance(getattr(module, name, None), torch.Tensor):
                    setattr(module, name, getattr(module, name).to(device))
    for cls in (RotaryEmbedding, YarnRotaryEmbedding):
        cache_clear = getattr(cls.forward, "cache_clear", None)
        if cache_clear is not None:  # megatron-core versions without the cache hold no tables
            cache_clear()
