"""The batched runner's slot KV cache: one row per running sequence, per layer (no tensor math
beyond copies; the runner in slime.engines.torch_engine.model_runner reads and writes it).

Two layouts of a layer's buffer, chosen once:
* head-major (rows, kv_heads, length, head_dim): a row's keys of one head are contiguous, what the
  batched-matmul and scaled_dot_product_attention decode kernels read (slime.engines.torch_engine
  .attention);
* token-major (rows, length, kv_heads, head_dim): a row's tokens follow each other, so the whole
  buffer is one variable-length key sequence per row, `length` apart, and the flash kernel reads
  each row's live keys alone (`live_decode_attention`).

With `values_in_keys` N (multi-latent attention: slime.engines.torch_engine.layers) there is no
value buffer: a position's value is the first N numbers of its key, read in place.
"""

from __future__ import annotations

import torch


class SlotKVCache:
    """Per-layer K/V buffers, grown by doubling (see the module docstring for the layouts)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        max_rows: int,
        max_len: int,
        token_major: bool = False,
        values_in_keys: int | None = None,
    ):
        self.values_in_keys = values_in_keys
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.max_rows, self.max_len = max_rows, max_len
        self.token_major = token_major
        self.rows = 0
        self.length = 0
        self.generation = 0
        """Bumped whenever the buffers are replaced (CUDA graphs hold their addresses)."""
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def _shape(self, rows: int, length: int) -> tuple[int, ...]:
        if self.token_major:
            return (rows, length, self.num_kv_heads, self.head_dim)
        return (rows, self.num_kv_heads, length, self.head_dim)

    def _index(self, rows: slice | int | torch.Tensor, tokens: slice | torch.Tensor) -> tuple:
        """The index of `tokens` of `rows` (every head) in a layer's buffer."""
        return (rows, tokens) if self.token_major else (rows, slice(None), tokens)

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
        # One layer at a time, each old buffer dropped once copied: growing costs the new cache
        # plus one old layer at the peak, not both caches (on a GPU, with hundreds of rows of long
        # sequences, both would not fit; the allocator hands freed blocks back when short). An
        # allocation that fails part way leaves the cache empty: the engine fails the requests it
        # held and resets the runner, as after any failed step (TorchEngine._fail_in_flight).
        old_part = self._index(slice(0, self.rows), slice(0, self.length))
        shape = self._shape(new_rows, new_len)
        try:
            for store in self._stores():
                for i in range(self.num_layers):
                    fresh = torch.zeros(shape, dtype=self.dtype, device=self.device)
                    if i < len(store):
                        fresh[old_part] = store[i]
                        store[i] = fresh
                    else:
                        store.append(fresh)
        except BaseException:
            self.free()
            raise
        self.rows, self.length = new_rows, new_len
        self.generation += 1

    def write_prefill(self, layer: int, rows: slice, k: torch.Tensor, v: torch.Tensor) -> None:
        """New rows' keys/values from position 0: k, v [rows, kv_heads, T, head_dim]."""
        T = k.shape[2]
        if self.token_major:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        index = self._index(rows, slice(0, T))
        self.k[layer][index] = k
        if self.values_in_keys is None:
            self.v[layer][index] = v

    def write_decode(
        self, layer: int, rows: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """One new position per row: k, v [rows, kv_heads, 1, head_dim] at `positions` [rows]."""
        index = self._index(rows, positions)
        self.k[layer][index] = k[:, :, 0]
        if self.values_in_keys is None:
            self.v[layer][index] = v[:, :, 0]

    def view(self, layer: int, rows: slice, key_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of `rows`' first `key_len` positions, [rows, kv_heads, key_len,
        head_dim] (a view, strided in the token-major layout)."""
        index = self._index(rows, slice(0, key_len))
        k = self.k[layer][index]
        v = self.v[layer][index] if self.values_in_keys is None else k[..., : self.values_in_keys]
        return (k.transpose(1, 2), v.transpose(1, 2)) if self.token_major else (k, v)

    def _stores(self) -> tuple[list[torch.Tensor], ...]:
        return (self.k,) if self.values_in_keys is not None else (self.k, self.v)

    def move_row(self, src: int, dst: int, length: int) -> None:
        for store in self._stores():
            for buf in store:
                buf[self._index(dst, slice(0, length))] = buf[self._index(src, slice(0, length))]

    def free(self) -> None:
        self.k, self.v = [], []
        self.rows = self.length = 0
        self.generation += 1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def _next_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()
