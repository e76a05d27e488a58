"""Core attention for packed micro-batches with megatron-core's local layer spec.

megatron-core's own local attention (DotProductAttention) refuses packed sequences (THD,
`packed_seq_params`): only Transformer Engine's attention takes them, and Transformer Engine
needs a GPU. Everything else in megatron-core's attention already handles THD on any device (the
squeezed [tokens, heads, dim] layout, rotary embeddings restarting at each sequence of
`cu_seqlens`), so this subclass adds the one missing piece: causal attention within each packed
sequence (slime.backends.packed_attention.causal_per_segment, torch's
scaled_dot_product_attention per sequence, or on a GPU in half precision torch's flash-attention
varlen kernel over the whole row, called as the installed torch accepts). Padded micro-batches
go to megatron-core's code unchanged. With context parallelism both core attentions here run
slime.backends.megatron.context_parallel's (megatron-core's local attention refuses CP). Imported
only where megatron-core is installed.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.module import MegatronModule

from slime.backends.megatron.context_parallel import cp_attention
from slime.backends.packed_attention import causal_per_segment


def _cp_group(config: Any) -> Any:
    """The context-parallel group (None without CP)."""
    if config.context_parallel_size == 1:
        return None
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_group()


class SegmentDotProductAttention(DotProductAttention):
    """DotProductAttention that also takes packed sequences (`packed_seq_params` in THD format),
    and context parallelism (slime.backends.megatron.context_parallel)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        self.cp_group = _cp_group(config)
        if self.cp_group is not None:  # DotProductAttention refuses CP: it sees a config without
            config = copy.copy(config)
            config.context_parallel_size = 1
        super().__init__(config, *args, **kwargs)

    def forward(  # type: ignore[override]
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is None and self.cp_group is None:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias)
        if (
            (packed_seq_params is not None and packed_seq_params.qkv_format != "thd")
            or attention_bias is not None
            or self.softmax_offset is not None
        ):
            raise NotImplementedError(
                "packed sequences with megatron-core's local attention: THD format, no attention bias and "
                "vanilla softmax only (use --padded-micro-batches)"
            )
        if self.config.window_size is not None:
            raise NotImplementedError(
                "packed sequences with sliding-window attention: use --padded-micro-batches"
            )
        # DotProductAttention divides its scale by the layer number under
        # apply_query_key_layer_scaling and multiplies it back in the softmax.
        scale = self.softmax_scale * (self.layer_number if self.config.apply_query_key_layer_scaling else 1)
        dropout = self.attention_dropout.p if self.training else 0.0
        if self.cp_group is not None:
            return cp_attention(query, key, value, packed_seq_params, self.cp_group, scale, dropout)
        return _packed(query, key, value, packed_seq_params, scale, dropout)


def _causal(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: Any,
    longest: Any,
    scale: float | None,
    dropout: float,
) -> torch.Tensor:
    """causal_per_segment on [batch, heads, tokens, dim], dropout drawn from megatron-core's tracker."""
    with tensor_parallel.get_cuda_rng_tracker().fork() if dropout else contextlib.nullcontext():
        return causal_per_segment(q, k, v, cu, longest, scale, dropout)


def _packed(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    params: Any,
    scale: float | None,
    dropout: float,
) -> torch.Tensor:
    """Causal attention within each packed sequence: [tokens, heads, dim] in (THD), [tokens,
    heads * dim] out (megatron-core adds the batch axis back)."""
    q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))  # [1, heads, tokens, dim]
    out = _causal(q, k, v, params.cu_seqlens_q, params.max_seqlen_q, scale, dropout)
    return out[0].permute(1, 0, 2).reshape(out.shape[2], -1)


class LatentCoreAttention(MegatronModule):
    """Core attention for megatron-core's multi-latent attention with the local layer spec.

    MLA gives each head keys of qk_head_dim + qk_pos_emb_head_dim channels and values of
    v_head_dim; megatron-core's local DotProductAttention takes one head width for both (and no
    `k_channels` / `v_channels`), so MLA builds only with Transformer Engine's attention there.
    This one is torch's scaled_dot_product_attention, causal, over padded rows or within each
    packed sequence (slime.backends.packed_attention.causal_per_segment), with MLA's softmax scale.
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config=config)
        self.cp_group = _cp_group(config)
        self.softmax_scale = softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if attention_mask is not None or attention_bias is not None:
            raise NotImplementedError(
                "multi-latent attention here is causal only (no attention mask or bias)"
            )
        dropout = self.dropout if self.training else 0.0
        if self.cp_group is not None:  # (packed rows only: cp_attention refuses others)
            return cp_attention(
                query, key, value, packed_seq_params, self.cp_group, self.softmax_scale, dropout
            )
        if packed_seq_params is None:  # [s, b, heads, dim] -> [b, heads, s, dim]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = _causal(q, k, v, None, None, self.softmax_scale, dropout)
            return out.permute(2, 0, 1, 3).reshape(out.shape[2], out.shape[0], -1)
        if packed_seq_params.qkv_format != "thd":
            raise NotImplementedError("packed sequences with multi-latent attention: THD format only")
        return _packed(query, key, value, packed_seq_params, self.softmax_scale, dropout)
