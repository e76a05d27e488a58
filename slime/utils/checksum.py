"""Per-tensor fingerprints: equal fingerprints mean bitwise-equal tensors (same dtype and shape).

The trainer and the engine compute them the same way, so a weight sync can be verified by
comparing a few dozen bytes per tensor instead of moving the tensors back.
"""

from __future__ import annotations

import hashlib

import torch


def tensor_checksum(tensor: torch.Tensor) -> str:
    """sha256 over dtype, shape and the raw bytes of `tensor` (moved to CPU, contiguous)."""
    t = tensor.detach().to("cpu").contiguous()
    h = hashlib.sha256(f"{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
