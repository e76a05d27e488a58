"""Group named tensors into buckets of at most N bytes (a larger tensor gets a bucket alone)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def iter_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield consecutive [(name, tensor)] lists of at most `bucket_bytes` bytes each.

    `named` is consumed lazily, so a generator that gathers each tensor when asked keeps at most
    one bucket (plus the tensor that starts the next one) alive.
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket size must be >= 1 byte, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
