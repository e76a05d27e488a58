"""Causal attention over packed micro-batches, each sample attending only to itself
(`attn_implementation="slime_segments"`).

Hugging Face's own sdpa and eager paths isolate packed samples by building a mask over the whole
row (tokens x tokens), which on CPU made a packed micro-batch slower than the padded one when
micro-batches hold samples of similar length (docs/train.md). This implementation instead runs
torch's scaled_dot_product_attention causally on each sample's slice of the row, given the
samples' boundaries (`cu_seq_lens_q`, the keyword flash-attn's varlen path takes too): exact, no
mask, and the linear layers still see the whole packed row. Samples of equal length attend in one
batched call. On CUDA in half precision the whole row is one call of torch's flash-attention
varlen kernel instead. Without boundaries (one sample per row, right-padded) it is plain causal
attention: right padding never reaches a real token.
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
    if bounds is not None and _varlen_applies(query, dropout_p):
        return _varlen(query, key, value, bounds, scale)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if bounds is None:
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, dropout_p=dropout_p
        )
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    batch = query.shape[0]
    if len(set(lengths)) == 1 and batch == 1:  # equal lengths: the samples are a batch, no copies
        n, length = len(lengths), lengths[0]
        q, k, v = (t[0].unflatten(1, (n, length)).transpose(0, 1) for t in (query, key, value))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p)
        return o.transpose(0, 1).flatten(1, 2).unsqueeze(0)
    # Otherwise samples of equal length attend in one batched call, the others one call each.
    # `split` views have a single backward node (slicing each sample would allocate a gradient
    # of the whole row per sample).
    parts = [t.split(lengths, dim=2) for t in (query, key, value)]
    members_by_length: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        members_by_length.setdefault(n, []).append(i)
    out: list[torch.Tensor] = [query] * len(lengths)
    for members in members_by_length.values():
        q, k, v = (p[members[0]] if len(members) == 1 else torch.cat([p[i] for i in members]) for p in parts)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, dropout_p=dropout_p)
        for i, piece in zip(members, o.split(batch)):
            out[i] = piece
    return torch.cat(out, dim=2)


def _varlen_applies(query: torch.Tensor, dropout_p: float) -> bool:
    """torch's flash-attention varlen kernel (torch.nn.attention.varlen, torch >= 2.10): CUDA,
    half precision, no dropout. Elsewhere the per-segment loop runs."""
    if not query.is_cuda or query.dtype not in (torch.float16, torch.bfloat16) or dropout_p:
        return False
    try:
        from torch.nn.attention import varlen  # noqa: F401
    except ImportError:
        return False
    return True


def _varlen(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bounds: list[int], scale: float | None
) -> torch.Tensor:
    """`causal_per_segment` in one kernel call (batch 1: the packed row)."""
    from torch.nn.attention.varlen import varlen_attn

    assert query.shape[0] == 1, "a packed micro-batch is one row"
    cu = torch.tensor(bounds, dtype=torch.int32, device=query.device)
    longest = max(b - a for a, b in itertools.pairwise(bounds))
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [tokens, heads, dim]
    out = varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(-1, 0),
                      enable_gqa=k.shape[1] != q.shape[1])  # fmt: skip
    assert isinstance(out, torch.Tensor)  # no auxiliary outputs were asked for
    return out.transpose(0, 1).unsqueeze(0)


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
