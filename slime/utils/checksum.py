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


def bytes_sha256(tensor: torch.Tensor) -> str:
    """sha256 of the raw bytes alone (no dtype or shape), as SGLang's `expected_checksums` of
    /load_lora_adapter_from_tensors computes it on the tensors it received."""
    t = tensor.detach().to("cpu").contiguous()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()


def _word_sum(tensor: torch.Tensor) -> int:
    """The sum, in wrapping int64, of the tensor's bytes read as 8-byte words (the last < 8
    bytes added one by one). Depends only on the bytes, not on alignment or thread count."""
    flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    head = flat.numel() - flat.numel() % 8
    words = flat[:head]
    if head and words.data_ptr() % 8:
        words = words.clone()  # an int64 view needs 8-byte alignment
    total = int(words.view(torch.int64).sum()) if head else 0
    if head < flat.numel():
        total += int(flat[head:].to(torch.int64).sum())
    return (total + 2**63) % 2**64 - 2**63


def tensor_fingerprint(tensor: torch.Tensor) -> list[int]:
    """Three integers that change whenever any element's bits change, and when the tensor is
    transposed or swapped with another: wrapping int64 sums of its bytes as 8-byte words, over
    the whole tensor, over its first slice along dim 0 and over its last.

    Integer sums do not depend on the reduction order, so the trainer and an engine get the
    same numbers for the same bits whatever their thread counts. One read of the memory and no
    copy (unlike tensor_checksum's sha256; measured at a quarter of a memory copy's time):
    cheap enough to run after every weight push. Dtype and shape are compared separately.
    """
    if tensor.dim() == 0 or tensor.numel() == 0:
        value = _word_sum(tensor)
        return [value, value, value]
    t = tensor.detach()
    row_bytes = t[0].numel() * t.element_size()
    if t.is_contiguous() and row_bytes % 8 == 0 and t.data_ptr() % 8 == 0:
        # One pass: the word sums of every row; their (wrapping) sum is the whole tensor's.
        rows = t.view(torch.uint8).view(-1).view(torch.int64).view(t.shape[0], -1).sum(dim=1)
        return [_wrap(int(rows.sum())), _wrap(int(rows[0])), _wrap(int(rows[-1]))]
    return [_word_sum(t), _word_sum(t[0]), _word_sum(t[-1])]


def _wrap(value: int) -> int:
    return (value + 2**63) % 2**64 - 2**63


def fingerprint_entry(tensor: torch.Tensor) -> dict[str, object]:
    """What --check-weight-sync compares for one tensor: dtype, shape and tensor_fingerprint."""
    return {
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "shape": list(tensor.shape),
        "fingerprint": tensor_fingerprint(tensor),
    }
