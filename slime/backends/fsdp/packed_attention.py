"""Causal attention over packed micro-batches, one sample at a time (`attn_implementation="slime_segments"`).

Hugging Face's own sdpa and eager paths isolate packed samples by building a mask over the whole
row (tokens x tokens), which on CPU made a packed micro-batch slower than the padded one when
micro-batches hold samples of similar length (docs/performance.md). This implementation instead
runs torch's scaled_dot_product_attention causally on each sample's slice of the row, given the
samples' boundaries (`cu_seq_lens_q`, the keyword flash-attn's varlen path takes too): exact, no
mask, and the linear layers still see the whole packed row. Without boundaries (one sample per
row, right-padded) it is plain causal attention: right padding never reaches a real token.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F

NAME = "slime_segments"
_registered = False


def causal_per_segment(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: list[int] | None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention within each segment [bounds[i], bounds[i+1]) of the token axis (all of it
    when `bounds` is None). query [batch, heads, tokens, dim], key/value [batch, kv heads, tokens,
    dim] (grouped-query heads are repeated) -> [batch, heads, tokens, dim]."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if bounds is None:
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, dropout_p=dropout_p
        )
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                query[:, :, a:b],
                key[:, :, a:b],
                value[:, :, a:b],
                is_causal=True,
                scale=scale,
                dropout_p=dropout_p,
            )
            for a, b in itertools.pairwise(bounds)
        ],
        dim=2,
    )


def segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Hugging Face's attention-function signature: query [batch, heads, tokens, dim] ->
    [batch, tokens, heads, dim], the segments from `cu_seq_lens_q`."""
    cu = kwargs.get("cu_seq_lens_q")
    out = causal_per_segment(query, key, value, None if cu is None else cu.tolist(), scaling,
                             dropout if module.training else 0.0)  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None  # causal attention per sample needs none (module docstring)


def register() -> str:
    """Make `attn_implementation="slime_segments"` known to transformers; returns the name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface, AttentionMaskInterface

        AttentionInterface.register(NAME, segment_attention)
        AttentionMaskInterface.register(NAME, _no_mask)
        _registered = True
    return NAME
