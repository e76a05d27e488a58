"""The batched runner's slot KV cache: one row per running sequence, per layer (no tensor math
beyond copies; the runner in slime.engines.torch_engine.model_runner reads and writes it)."""

from __future__ import annotations

import torch


class SlotKVCache:
    """Per-layer K/V buffers of shape (rows, kv_heads, length, head_dim), grown by doubling."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_rows: int,
        max_len: int,
    ):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.max_rows, self.max_len = max_rows, max_len
        self.rows = 0
        self.length = 0
        self.generation = 0
        """Bumped whenever the buffers are replaced (CUDA graphs hold their addresses)."""
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def ensure(self, rows: int, length: int) -> None:
        if rows <= self.rows and length <= self.length:
            return
        new_rows = max(self.rows, min(self.max_rows, _next_pow2(max(rows, 8))))
        new_len = max(self.length, min(self.max_len, _next_pow2(max(length, 128))))
        if rows > new_rows or length > new_len:
            raise ValueError(
                f"KV cache request {rows} rows x {length} tokens exceeds the limit "
                f"{self.max_rows} x {self.max_len}"
            )
        shape = (new_rows, self.num_kv_heads, new_len, self.head_dim)
        # Build every new buffer before touching the old ones: if an allocation fails (OOM)
        # half way, the cache keeps its old buffers and sizes and the running sequences'
        # keys/values stay valid. The price is holding old and new buffers at once.
        new_k: list[torch.Tensor] = []
        new_v: list[torch.Tensor] = []
        for old, new in ((self.k, new_k), (self.v, new_v)):
            for i in range(self.num_layers):
                fresh = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if i < len(old):
                    fresh[: self.rows, :, : self.length] = old[i]
                new.append(fresh)
        self.k, self.v = new_k, new_v
        self.rows, self.length = new_rows, new_len
        self.generation += 1

    def move_row(self, src: int, dst: int, length: int) -> None:
        for store in (self.k, self.v):
            for buf in store:
                buf[dst, :, :length] = buf[src, :, :length]

    def free(self) -> None:
        self.k, self.v = [], []
        self.rows = self.length = 0
        self.generation += 1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def _next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()
