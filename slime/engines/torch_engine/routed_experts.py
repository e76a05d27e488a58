"""The experts a mixture-of-experts model's routers chose, recorded for the sequences that ask
(`return_routed_experts`, SGLang's field; slime's routing replay, R3, trains on them)."""

from __future__ import annotations

from typing import Any

import torch

from slime.engines.torch_engine.sequence import Sequence
from slime.utils import hf_experts


class RoutedExperts:
    """Forward hooks on the routers of `layers`, recording a forward's choices when `begin` was
    told that one of its sequences asks for them."""

    def __init__(self, layers: Any):
        self.routers = hf_experts.find_routers(layers)
        self.num_layers = len(layers)
        self.top_k = next((r.top_k for r in self.routers.values()), 0)
        self._chosen: dict[int, torch.Tensor] | None = None
        for li, router in self.routers.items():
            router.register_forward_hook(self._hook(li))

    def _hook(self, li: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            if self._chosen is not None:
                self._chosen[li] = output[2]  # the top-k expert indices, [tokens, k]

        return hook

    def begin(self, seqs: list[Sequence]) -> bool:
        """Whether the next forward records (one of `seqs` asks for its experts)."""
        self._chosen = {} if any(s.return_routed_experts for s in seqs) else None
        return self._chosen is not None

    def keep_prefill(self, seqs: list[Sequence], lengths: list[int], T: int) -> None:
        """After a prefill that recorded: each sequence that asked keeps its prompt tokens' experts."""
        if self._chosen is None:
            return
        for s, row, n in zip(seqs, self._rows(len(seqs), T), lengths):
            s.routed_experts = [row[:n]] if s.return_routed_experts else []

    def append_decode(self, seqs: list[Sequence], rows: int) -> None:
        """After a decode step of `rows` rows that recorded: each sequence that asked appends its
        new token's experts."""
        if self._chosen is None:
            return
        for s, row in zip(seqs, self._rows(rows, 1)):
            if s.return_routed_experts:
                s.routed_experts.append(row)

    def _rows(self, B: int, T: int) -> torch.Tensor:
        """What the routers chose in the last forward: [B, T, layers, top-k] int32 (dense layers 0);
        recording stops."""
        assert self._chosen is not None
        out = torch.zeros((B, T, self.num_layers, self.top_k), dtype=torch.int32)
        for li, indices in self._chosen.items():
            out[:, :, li] = indices.view(B, T, -1).to("cpu", torch.int32)
        self._chosen = None
        return out
