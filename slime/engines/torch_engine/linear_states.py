"""The batched runner's per-row states of a hybrid model's linear-attention layers (the gated
delta-nets of Qwen3-Next and Qwen3.5): for each such layer, each running sequence's convolution
state (the last conv_kernel_size inputs of its short convolution) and recurrent state, in the
same rows as the sequence's keys and values in the KV cache (slime.engines.torch_engine.kv_cache).

The layer is transformers' own module, run with `RowStates` as its cache: the object answers the
few calls the module makes of a cache (`get_conv_state`, `update_conv_state`, ...) with views of
the rows the forward covers, so the module's decode step updates the convolution state in place
and hands back the new recurrent state, both into the sequences' own rows. A prefill starts each
row from no state, so it must run one sequence at a time: right padding would run the recurrence
past a prompt's last token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from slime.engines.torch_engine.kv_cache import _next_pow2


class LinearStates:
    """Convolution and recurrent states by decoder-layer index, [rows, ...] each, allocated at a
    layer's first state (its shape and dtype are the module's) and grown by doubling."""

    def __init__(self, max_rows: int):
        self.max_rows = max_rows
        self.rows = 0
        self.conv: dict[int, torch.Tensor] = {}
        self.recurrent: dict[int, torch.Tensor] = {}

    def ensure(self, rows: int) -> None:
        if rows <= self.rows:
            return
        new_rows = min(self.max_rows, _next_pow2(max(rows, 8)))
        if rows > new_rows:
            raise ValueError(f"linear-attention states: {rows} rows exceed the limit {self.max_rows}")
        for store in (self.conv, self.recurrent):
            for li, old in store.items():
                fresh = old.new_zeros((new_rows, *old.shape[1:]))
                fresh[: self.rows] = old[: self.rows]
                store[li] = fresh
        self.rows = new_rows

    def store(self, kind: dict[int, torch.Tensor], li: int, rows: slice, value: torch.Tensor) -> None:
        if li not in kind:
            kind[li] = value.new_zeros((self.rows, *value.shape[1:]))
        kind[li][rows] = value

    def move_row(self, src: int, dst: int) -> None:
        for store in (self.conv, self.recurrent):
            for buf in store.values():
                buf[dst] = buf[src]

    def free(self) -> None:
        self.conv, self.recurrent = {}, {}
        self.rows = 0

    def of(self, rows: slice, prefill: bool) -> RowStates:
        return RowStates(self, rows, prefill)


class RowStates:
    """The cache a linear-attention module sees in one forward over `rows`: at prefill no earlier
    state (the module starts from zeros and reports the final states, stored here); at decode the
    rows' states, which the module updates."""

    def __init__(self, states: LinearStates, rows: slice, prefill: bool):
        self.states, self.rows, self.prefill = states, rows, prefill

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.prefill else self.states.conv[layer_idx][self.rows]

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return None if self.prefill else self.states.recurrent[layer_idx][self.rows]

    def is_recording_past(self, layer_idx: int) -> bool:
        return False

    def update_conv_state(
        self, conv_input: torch.Tensor, layer_idx: int, conv_kernel_size: int = 4, **kwargs: object
    ) -> torch.Tensor:
        """A prefill's convolution input [rows, channels, T]: its last `conv_kernel_size` columns
        (zeros before a shorter prompt) become the rows' state; returned left-padded to at least
        the kernel, as transformers' cache returns it."""
        pad = max(0, conv_kernel_size - conv_input.shape[-1])
        full = F.pad(conv_input, (pad, 0)) if pad else conv_input
        self.states.store(self.states.conv, layer_idx, self.rows, full[..., -conv_kernel_size:])
        return full

    def update_recurrent_state(self, state: torch.Tensor, layer_idx: int, **kwargs: object) -> torch.Tensor:
        self.states.store(self.states.recurrent, layer_idx, self.rows, state)
        return state
