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
"""

from __future__ import annotations

import functools

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
    """One query per row: q [B, H, 1, D], k/v [B, KV, S, D], mask [B, 1, 1, S] (True: attend)
    -> [B, H, 1, D]. Only matmuls and elementwise kernels (no per-shape plan, capturable in a
    CUDA graph)."""
    B, H, _, D = q.shape
    KV, S = k.shape[1], k.shape[2]
    groups = H // KV
    q_rows = q.reshape(B * KV, groups, D)  # query heads of one KV head are consecutive (HF's layout)
    scores = _scores(q_rows, k.reshape(B * KV, S, D).transpose(1, 2)).view(B, KV, groups, S)
    scores = scores * scale
    scores = scores.masked_fill(~mask.view(B, 1, 1, S), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.bmm(probs.view(B * KV, groups, S), v.reshape(B * KV, S, D))
    return out.view(B, H, 1, D)


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
