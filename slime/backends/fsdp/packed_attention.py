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
    """query [batch, heads, tokens, dim], key/value [batch, kv heads, tokens, dim] ->
    [batch, tokens, heads, dim]."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    p = dropout if module.training else 0.0
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, dropout_p=p)
    else:
        bounds = cu.tolist()
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    query[:, :, a:b],
                    key[:, :, a:b],
                    value[:, :, a:b],
                    is_causal=True,
                    scale=scaling,
                    dropout_p=p,
                )
                for a, b in itertools.pairwise(bounds)
            ],
            dim=2,
        )
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
