"""Attention kernels of the batched runner, chosen by device.

CPU: torch's scaled_dot_product_attention with an explicit mask (what the engine always ran; the
float32 log-prob parity tests hold it).

CUDA: no kernel that builds an execution plan per shape. `F.scaled_dot_product_attention` may
take cuDNN's backend there, which runtime-compiles a plan for every new shape; in a decode loop
that was most of the time (docs/gpu.md). So:
* decode (one query per row over the cached keys): two batched matmuls and a float32 softmax,
  written out here. Grouped-query heads are folded into the matmul's rows, so keys and values
  are read once and never repeated; the scores are float32 where torch's bmm can write them
  (`out_dtype`), as flash kernels keep them.
* prefill (right-padded prompts from position 0): causal SDPA with no mask (causality alone keeps
  the right padding away from real positions), restricted to the flash / memory-efficient / math
  backends.
* decode reading only the live keys (`live_decode_attention`, where `live_keys_kernel` finds the
  flash kernel): the cache is token-major, each row a key sequence of its own in one flat buffer
  (`cu_seq_k` = row x length), and the kernel reads `seqused_k` = position + 1 keys of each row:
  no key is read for padding, however long the longest row. Its shapes never change with the
  rows' lengths: a bucket of rows keeps its CUDA graph until the cache grows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def sdpa_masked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, KV, S, D], boolean mask broadcastable to [B, H, T, S]."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
    )


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per row: q [B, H, 1, D], k [B, KV, S, D], v [B, KV, S, Dv], mask [B, 1, 1, S]
    (True: attend) -> [B, H, 1, Dv]. Only matmuls and elementwise kernels (no per-shape plan, capturable in a
    CUDA graph)."""
    B, H, _, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    groups = H // KV
    q_rows = q.reshape(B * KV, groups, D)  # query heads of one KV head are consecutive (HF's layout)
    scores = _scores(q_rows, k.reshape(B * KV, S, D).transpose(1, 2)).view(B, KV, groups, S)
    scores = scores * scale
    scores = scores.masked_fill(~mask.view(B, 1, 1, S), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    value_dim = v.shape[-1]  # multi-latent attention: narrower than the keys
    out = torch.bmm(probs.view(B * KV, groups, S), v.reshape(B * KV, S, value_dim))
    return out.view(B, H, 1, value_dim)


def _scores(q_rows: torch.Tensor, k_t: torch.Tensor) -> torch.Tensor:
    """q @ k^T in float32: straight from the half-precision inputs where bmm takes `out_dtype`."""
    if q_rows.dtype == torch.float32:
        return torch.bmm(q_rows, k_t)
    if _bmm_out_dtype(q_rows.device.type):
        return torch.bmm(q_rows, k_t, out_dtype=torch.float32)
    return torch.bmm(q_rows, k_t).float()  # rounded to half precision first, as eager attention does


@functools.cache
def _bmm_out_dtype(device_type: str) -> bool:
    """Whether this torch's bmm writes float32 from half-precision inputs on this device."""
    try:
        a = torch.ones(1, 1, 1, dtype=torch.bfloat16, device=device_type)
        return torch.bmm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def prefill_attention_cuda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of right-padded prompts that start at position 0 (q, k, v of equal
    length), without cuDNN's per-shape plans."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(backends):
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )


# The kernel's call, as the flash kernels take it: query [B, H, D] (one query per row), keys and
# values [N, KV, D] with row i's at cu_seq_k[i] + [0, seqused_k[i]), -> [B, H, D].
LiveKernel = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class LiveRows:
    """Where a decode step's sequences keep their keys in a token-major layer buffer [rows, length,
    KV, D] (slime.engines.torch_engine.kv_cache): sequence i in row first_row + i, its first
    `seqused_k[i]` positions live. Made once per step, on the device, for every layer."""

    first_row: int
    length: int
    seqused_k: torch.Tensor
    """[B] int32."""
    cu_q: torch.Tensor
    """[B + 1] int32: one query per sequence."""
    cu_k: torch.Tensor
    """[B + 1] int32: each sequence's keys start `length` after the one before."""

    @classmethod
    def of(cls, positions: torch.Tensor, first_row: int, length: int) -> LiveRows:
        """`positions` [B]: where each sequence's new token goes (its keys up to there are live)."""
        cu_q = torch.arange(positions.shape[0] + 1, dtype=torch.int32, device=positions.device)
        return cls(first_row, length, (positions + 1).to(torch.int32), cu_q, cu_q * length)


def live_decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    rows: LiveRows,
    scale: float,
    kernel: LiveKernel,
) -> torch.Tensor:
    """One query per sequence over its live keys alone: q [B, H, 1, D]; k_buf, v_buf a token-major
    layer buffer laid out as `rows` says -> [B, H, 1, D]. No host synchronisation (CUDA-graph
    safe)."""
    B = q.shape[0]
    k = k_buf[rows.first_row : rows.first_row + B].flatten(0, 1)  # rows are `length` apart: a view
    v = v_buf[rows.first_row : rows.first_row + B].flatten(0, 1)
    out = kernel(q[:, :, 0], k, v, rows.cu_q, rows.cu_k, 1, rows.length, rows.seqused_k, scale)
    return out[:, :, None]


def _flash_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    seqused_k: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    # The aten op rather than torch.nn.attention.varlen.varlen_attn: the wrapper's keywords moved
    # from release to release (torch 2.11's has no seqused_k), the op's have not since it took
    # seqused_k; grouped-query heads are native to it (num_heads a multiple of KV heads).
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, False, False, scale=scale, seqused_k=seqused_k
    )[0]


def live_keys_kernel(device: torch.device, dtype: torch.dtype, head_dim: int) -> LiveKernel | None:
    """The flash kernel that reads only each row's live keys, where it runs: CUDA, Ampere or
    newer, half precision, a head dimension that is a multiple of 8 up to 256 (the op pads
    nothing itself), and a torch whose flash op takes seqused_k. None elsewhere (the padded-key
    kernels above run instead)."""
    if (
        device.type != "cuda"
        or dtype not in (torch.float16, torch.bfloat16)
        or head_dim > 256
        or head_dim % 8
    ):
        return None
    if torch.cuda.get_device_capability(device) < (8, 0) or not _takes_seqused_k():
        return None
    return _flash_varlen


@functools.cache
def _takes_seqused_k() -> bool:
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return op is not None and "seqused_k" in str(op.default._schema)
