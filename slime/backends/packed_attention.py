"""Causal attention over packed micro-batches, each sample attending only to itself
(`attn_implementation="slime_segments"`).

Hugging Face's own sdpa and eager paths isolate packed samples by building a mask over the whole
row (tokens x tokens), which on CPU made a packed micro-batch slower than the padded one when
micro-batches hold samples of similar length (docs/train.md). This implementation instead runs
torch's scaled_dot_product_attention causally on each sample's slice of the row, given the
samples' boundaries (`cu_seq_lens_q`, the keyword flash-attn's varlen path takes too): exact, no
mask, and the linear layers still see the whole packed row. Samples of equal length attend in one
batched call. On CUDA in half precision the whole row is one call of torch's flash-attention
varlen kernel instead, where the installed torch's kernel takes the keywords the call needs
(`_varlen_call`). Without boundaries (one sample per row, right-padded) it is plain causal
attention: right padding never reaches a real token.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import logging
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from slime.backends.micro_batch import host_bounds

logger = logging.getLogger(__name__)

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
    # (the varlen kernel takes one head width: multi-latent attention's values are narrower)
    if cu_seq_lens is not None and query.shape[-1] == value.shape[-1] and _varlen_applies(query, dropout_p):
        out = _varlen(query, key, value, cu_seq_lens, longest, scale)
        if out is not None:  # None: the installed kernel lacks a keyword this call needs
            return out
    return _per_segment(query, key, value, cu_seq_lens, scale, dropout_p)


def _per_segment(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens: torch.Tensor | None,
    scale: float | None,
    dropout_p: float,
) -> torch.Tensor:
    """`causal_per_segment` without the varlen kernel: scaled_dot_product_attention per segment."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if cu_seq_lens is None:
        return F.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scale, dropout_p=dropout_p
        )
    bounds = host_bounds(cu_seq_lens)
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


# varlen_attn's keywords changed from release to release (GPU users get torch from SGLang's pin):
#   2.10: varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None)
#   2.11: varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
#                     window_size=(-1, -1))
#   2.12: as 2.11, plus enable_gqa=False, seqused_k=None, block_table=None, num_splits=None
# so the call is built from what the installed kernel's signature accepts.
@dataclasses.dataclass(frozen=True)
class _VarlenCall:
    keywords: tuple[tuple[str, Any], ...]
    """The fixed keywords: causality (window_size or is_causal), enable_gqa where it is taken."""
    takes_scale: bool
    repeat_kv: bool
    """Grouped-query heads repeated before the call (a kernel without enable_gqa)."""


@functools.cache
def _varlen_call(kernel: Callable[..., Any], grouped: bool, custom_scale: bool) -> _VarlenCall | None:
    """How to call `kernel` causally (None: it cannot be, the per-segment loop runs instead);
    `custom_scale`: a softmax scale other than 1/sqrt(head dim). Cached per kernel and case,
    so each choice is logged once."""
    try:
        parameters = frozenset(inspect.signature(kernel).parameters)
    except (TypeError, ValueError):  # a signature Python cannot read: take no chance with the call
        parameters = frozenset()
    keywords: list[tuple[str, Any]] = []
    if "window_size" in parameters:
        keywords.append(("window_size", (-1, 0)))  # (left, right): all before, none after
    elif "is_causal" in parameters:
        keywords.append(("is_causal", True))
    missing = [] if keywords else ["window_size or is_causal"]
    if custom_scale and "scale" not in parameters:
        missing.append("scale")
    if missing:
        logger.info(
            "packed attention: the per-segment loop (torch %s's varlen_attn lacks %s)",
            torch.__version__,
            " and ".join(missing),
        )
        return None
    takes_gqa = grouped and "enable_gqa" in parameters
    if takes_gqa:
        keywords.append(("enable_gqa", True))
    call = _VarlenCall(tuple(keywords), "scale" in parameters, grouped and not takes_gqa)
    logger.info(
        "packed attention: torch %s's varlen_attn with %s%s",
        torch.__version__,
        dict(keywords),
        ", grouped-query heads repeated" if call.repeat_kv else "",
    )
    return call


def _varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_lens: torch.Tensor,
    longest: int | None,
    scale: float | None,
) -> torch.Tensor | None:
    """`causal_per_segment` in one kernel call (batch 1: the packed row); None where the
    installed kernel cannot make this call. The bounds stay on the device: no host round trip
    per layer when the caller passes `longest`."""
    kernel = _varlen_kernel()
    assert kernel is not None and query.shape[0] == 1, "a packed micro-batch is one row"
    groups = query.shape[1] // key.shape[1]
    custom_scale = scale is not None and not math.isclose(scale, query.shape[-1] ** -0.5, rel_tol=1e-6)
    call = _varlen_call(kernel, groups > 1, custom_scale)
    if call is None:
        return None
    cu = cu_seq_lens.to(device=query.device, dtype=torch.int32)
    if longest is None:
        longest = int(cu.diff().max())
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [tokens, heads, dim]
    if call.repeat_kv:  # query head h reads key/value head h // groups, as the per-segment loop
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    keywords = dict(call.keywords)
    if call.takes_scale and scale is not None:
        keywords["scale"] = scale
    out = kernel(q, k, v, cu, cu, longest, longest, **keywords)
    assert isinstance(out, torch.Tensor)  # no auxiliary outputs were asked for
    return out.transpose(0, 1).unsqueeze(0)


# Under --fsdp-torch-compile (slime.backends.fsdp.compiled) the attention stays out of the
# compiled graph: one kernel already, whose per-segment path reads host-side bounds and whose
# longest segment is a Python int that would otherwise compile again for every new length.
@torch.compiler.disable
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
            f"packed micro-batches with slime_segments attention do not support {', '.join(unsupported)} "
            "(this model uses it): use --padded-micro-batches, or --attn-implementation "
            "eager/flash_attention_2"
        )
    out = causal_per_segment(
        query,
        key,
        value,
        kwargs.get("cu_seq_lens_q"),
        kwargs.get("max_length_q"),
        scaling,
        dropout if module.training else 0.0,
    ).transpose(1, 2)
    out = out.contiguous()
    torch._dynamo.maybe_mark_dynamic(out, 1)  # the token axis (slime.backends.fsdp.compiled)
    return out, None


def register() -> str:
    """Make `attn_implementation="slime_segments"` known to transformers; returns the name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface

        # No mask function: for an attention without one transformers builds no mask and looks
        # for no packed samples in the position ids either, a check that waits for the device
        # at every forward (masking_utils.find_packed_sequence_indices); this attention needs
        # neither (module docstring).
        AttentionInterface.register(NAME, segment_attention)
        _registered = True
    return NAME
