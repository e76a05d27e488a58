"""CUDA graphs of the batched runner's decode forward, one per (rows, key length) bucket.

A decode step of a small model is hundreds of small kernels, each launched from Python: the GPU
waits on the host. Captured once per bucket shape (slime.engines.torch_engine.shapes) and
replayed, a step is one launch, as SGLang and vLLM run their decode batches.

What a graph holds on to, and so what invalidates it (`clear`): the KV cache buffers (regrown or
freed), the parameters' storage (released and resumed memory; in-place weight updates keep it),
and the graphs' own memory pool. The runner clears the graphs whenever one of those changes.

Capture runs the step for real first (a warm-up outside the graph, on the live inputs: its KV
writes are the ones the step makes anyway, so writing them again in the replay is harmless),
then records it; the replay then computes the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)


@dataclass
class _Captured:
    graph: Any  # torch.cuda.CUDAGraph
    inputs: torch.Tensor
    logits: torch.Tensor


class DecodeGraphs:
    """Captures `forward(inputs [2, rows] int64 (token ids; positions), key_len) -> logits`
    per shape and replays it.

    Args:
        forward: the decode forward; must not synchronise with the host.
        max_rows: batches above this many rows run eagerly (SGLang's --cuda-graph-max-bs).
    """

    def __init__(self, forward: Callable[[torch.Tensor, int], torch.Tensor], max_rows: int):
        self.forward = forward
        self.max_rows = max_rows
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._pool: Any = None
        self.capture_seconds = 0.0
        self.num_replays = 0

    def covers(self, rows: int) -> bool:
        return rows <= self.max_rows

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(self, inputs: torch.Tensor, key_len: int) -> torch.Tensor:
        """The logits of one decode step (a view of the graph's output: read it before the next
        replay, on the same stream)."""
        key = (inputs.shape[1], key_len)
        entry = self._graphs.get(key)
        if entry is None:
            return self._capture(key, inputs)
        entry.inputs.copy_(inputs, non_blocking=True)
        entry.graph.replay()
        self.num_replays += 1
        return entry.logits

    def _capture(self, key: tuple[int, int], inputs: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        static = inputs.clone()
        # Warm-up on a side stream (as torch's capture recipe asks): lazy initialisations
        # (cuBLAS handles, workspaces) must not happen during capture. Its result is the step's.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            result = self.forward(static, key[1]).clone()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self.forward(static, key[1])
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[key] = _Captured(graph, static, logits)
        self.capture_seconds += time.perf_counter() - start
        logger.debug("captured the decode graph for %d rows x %d keys", *key)
        return result

    def clear(self) -> None:
        """Forget every graph and its memory pool (the next steps capture again)."""
        if self._graphs:
            logger.debug("dropping %d decode graphs", len(self._graphs))
        self._graphs.clear()
        self._pool = None
