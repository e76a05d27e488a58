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
    return {
        "num_moe_experts": layout.num_experts,
        "moe_ffn_hidden_size": layout.moe_ffn_hidden_size,
        "moe_layer_freq": list(layout.moe_layers),
        "moe_router_topk": moe["moe_router_topk"],
        "moe_router_pre_softmax": moe["moe_router_pre_softmax"],
        "moe_router_score_function": moe["moe_router_score_function"],
        "moe_router_dtype": router_dtype,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_grouped_gemm": layout.grouped_experts,
        "moe_token_dispatcher_type": "alltoall",
        "moe_permute_fusion": False,
    }


def transformer_config(layout: Layout, hf_config: Any, params_dtype: torch.dtype = torch.float32,
                       cpu_init: bool = False, router_dtype: str | None = None, **parallel: Any) -> Any:  # fmt: skip
    """megatron-core's TransformerConfig for the layout (plus TP/PP/CP/EP sizes in `parallel`)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
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
        **{
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
            **parallel,
        },
    )


def layer_spec(layout: Layout, moe: bool = False) -> Any:
    """One layer's spec: dense, or (`moe`) with megatron-core's MoE layer (SequentialMLP, or
    TEGroupedMLP with `layout.grouped_experts`)."""
    experts = {"num_experts": layout.num_experts, "moe_grouped_gemm": layout.grouped_experts} if moe else {}
    if layout.fold_norms:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=layout.qk_norm, **experts)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from slime.backends.megatron.attention import SegmentDotProductAttention

    spec = get_gpt_layer_local_spec(qk_layernorm=layout.qk_norm, normalization="RMSNorm", **experts)
    # megatron-core's local attention, plus packed sequences (slime.backends.megatron.attention)
    spec.submodules.self_attention.submodules.core_attention = SegmentDotProductAttention
    return spec


def block_spec(layout: Layout, pp: int, pp_rank: int) -> Any:
    """A dense model's layer spec, or for a MoE model the stage's layers one by one (MoE layers
    where `layout.moe_layers` says, dense ones elsewhere)."""
    if not layout.num_experts:
        return layer_spec(layout)
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    dense, moe = layer_spec(layout), layer_spec(layout, moe=True)
    layers = layout.stages(pp)[pp_rank]
    return TransformerBlockSubmodules(layer_specs=[moe if layout.is_moe(i) else dense for i in layers],
                                      layer_norm=LayerNormImpl)  # fmt: skip


def build_gpt_model(layout: Layout, hf_config: Any, config: Any, tp: int) -> Any:
    """This rank's GPTModel (its pipeline stage from megatron-core's parallel state)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_model import GPTModel

    moe_without_transformer_engine()
    pp, pp_rank = (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    return GPTModel(
        config,
        block_spec(layout, pp, pp_rank),
        vocab_size=layout.padded_vocab_size(tp),
        max_sequence_length=int(getattr(hf_config, "max_position_embeddings", 4096)),
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=layout.tied_embeddings,
        position_embedding_type="rope",
        rotary_base=rope_theta(hf_config),
    )


def moe_without_transformer_engine() -> None:
    """megatron-core 0.16's router reads the module global `te_general_gemm`, which its
    moe_utils defines only when Transformer Engine imports: without TE every MoE forward stops
    with a NameError. Its own fallback (a torch matmul in the router's dtype) is taken when the
    name is None, so define it as None where TE is absent (on any device)."""
    from megatron.core.transformer.moe import moe_utils

    if not getattr(moe_utils, "HAVE_TE", False) and not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # type: ignore[attr-defined]


def model_state(model: Any) -> dict[str, torch.Tensor]:
    """The tensors of a GPTModel's state dict (megatron-core's `_extra_state` entries left out)."""
    return {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}


def move_rotary_tables(model: Any, device: str | torch.device) -> None:
    """Move what megatron-core's rotary embedding keeps outside the module's parameters and
    buffers, which `model.to` misses: its `inv_freq` (a plain attribute, made on the GPU) and
    the tables its `forward` caches per sequence length (a class-wide lru_cache, emptied:
    computed again on use). Found by the first GPU run: 31,232 B left on the device after sleep."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    for module in model.modules():
        if isinstance(module, RotaryEmbedding) and isinstance(module.inv_freq, torch.Tensor):
            module.inv_freq = module.inv_freq.to(device)
    cache_clear = getattr(RotaryEmbedding.forward, "cache_clear", None)
    if cache_clear is not None:  # megatron-core versions without the cache hold no tables
        cache_clear()
