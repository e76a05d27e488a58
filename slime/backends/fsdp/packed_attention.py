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

import functools
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

NAME = "slime_segments"
_registered = False


def causal_per_segment(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens: torch.Tensor | None,
    longest: int | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Causal attention within each segment [cu[i], cu[i+1]) of the token axis (all of it when
    `cu_seq_lens` is None; `longest`: the longest segment, if the caller knows it). query [batch,
    heads, tokens, dim], key/value [batch, kv heads, tokens, dim] (grouped-query heads are
    repeated) -> [batch, heads, tokens, dim]."""
    if cu_seq_lens is not None and _varlen_applies(query, dropout_p):
        return _varlen(query, key, value, cu_seq_lens, longest, scale)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if cu_seq_lens is None:
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, dropout_p=dropout_p
        )
    lengths = [b - a for a, b in itertools.pairwise(cu_seq_lens.tolist())]
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


@functools.cache
def _varlen_kernel() -> Callable[..., Any] | None:
    """torch's flash-attention varlen kernel (torch.nn.attention.varlen, torch >= 2.10)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_applies(query: torch.Tensor, dropout_p: float) -> bool:
    """Where the varlen kernel runs: CUDA, Ampere or newer, half precision, head dimension up to
    256 (flash attention's limits), no dropout. Elsewhere the per-segment loop runs."""
    return (
        query.is_cuda
        and query.dtype in (torch.float16, torch.bfloat16)
        and not dropout_p
        and query.shape[-1] <= 256
        and torch.cuda.get_device_capability(query.device) >= (8, 0)
        and _varlen_kernel() is not None
    )


def _varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    longest: int | None,
    scale: float | None,
) -> torch.Tensor:
    """`causal_per_segment` in one kernel call (batch 1: the packed row). The bounds stay on the
    device: no host round trip per layer when the caller passes `longest`."""
    kernel = _varlen_kernel()
    assert kernel is not None and query.shape[0] == 1, "a packed micro-batch is one row"
    cu = cu_seq_lens.to(device=query.device, dtype=torch.int32)
    if longest is None:
        longest = int(cu.diff().max())
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [tokens, heads, dim]
    out = kernel(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(-1, 0),
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
    [batch, tokens, heads, dim], the segments from `cu_seq_lens_q` (`max_length_q` the longest)."""
    unsupported = [name for name in ("sliding_window", "softcap", "s_aux") if kwargs.get(name) is not None]
    if unsupported:
        raise NotImplementedError(
            f"packed micro-batches with slime_segments attention do not support {', '.join(unsupported)} (this "
            "model uses it): use --padded-micro-batches, or --attn-implementation eager/flash_attention_2"
        )
    out = causal_per_segment(query, key, value, kwargs.get("cu_seq_lens_q"), kwargs.get("max_length_q"), scaling,
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
