"""CUDA graphs of the batched runner's decode forward, one per (rows, key length) bucket.

A decode step of a small model is hundreds of small kernels, each launched from Python: the GPU
waits on the host. Captured once per bucket shape (slime.engines.torch_engine.shapes) and
replayed, a step is one launch, as SGLang and vLLM run their decode batches.

What a graph holds on to, and so what invalidates it (`clear`): the KV cache buffers (regrown or
freed), the parameters' storage (released and resumed memory; in-place weight updates keep it),
and the graphs' memory pool. The runner clears the graphs whenever one of those changes.

Memory: every graph shares one pool (they never run at once) and writes its logits into one
shared output buffer, so a graph holds no memory of its own beyond its small input tensor:
capturing dozens of buckets costs about one forward's activations, not one per bucket.

A bucket's first step runs for real (a warm-up outside the graph, on the live inputs; its KV
writes are the ones the step makes anyway, so writing them again in a replay is harmless) and
gives that step's logits; then the step is recorded, and later steps of that shape replay it. If
a capture fails (a forward that synchronises with the host, say), graphs are switched off for
good and the engine decodes eagerly, with the warm-up's logits for that step.
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
    """A view of the shared output buffer, this bucket's rows."""


class DecodeGraphs:
    """Captures `forward(inputs [2, rows] int64 (token ids; positions), key_len) -> logits`
    per shape and replays it.

    Args:
        forward: the decode forward; must not synchronise with the host.
        max_batch: batches of more sequences than this run eagerly (SGLang's --cuda-graph-max-bs).
        max_rows: the most rows a padded batch of `max_batch` sequences has (the output buffer's).
    """

    def __init__(self, forward: Callable[[torch.Tensor, int], torch.Tensor], max_batch: int, max_rows: int):
        self.forward = forward
        self.max_batch = max_batch
        self.max_rows = max_rows
        self._graphs: dict[tuple[int, int], _Captured] = {}
        self._pool: Any = None
        self._out: torch.Tensor | None = None
        self.failed: str | None = None
        """Why capturing failed (graphs are off from then on); None while they work."""
        self.capture_seconds = 0.0
        self.num_replays = 0

    def covers(self, num_seqs: int) -> bool:
        return self.failed is None and num_seqs <= self.max_batch

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def run(self, inputs: torch.Tensor, key_len: int) -> torch.Tensor:
        """The logits of one decode step (a view of the shared output buffer: read it before the
        next replay, on the same stream)."""
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
        rows, key_len = key
        static = inputs.clone()
        # Warm-up on a side stream (as torch's capture recipe asks): lazy initialisations
        # (cuBLAS handles, workspaces) must not happen during capture. Its result is the step's.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm = self.forward(static, key_len)
        torch.cuda.current_stream().wait_stream(side)
        result = warm.clone()
        if self._out is None or self._out.shape[1] != result.shape[1]:
            self._out = torch.empty(
                (max(self.max_rows, rows), result.shape[1]), dtype=result.dtype, device=result.device
            )
        out = self._out[:rows]
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: another thread's CUDA calls (a weight-update group starting) may not
            # invalidate this capture, nor this capture theirs.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                out.copy_(self.forward(static, key_len))
        except Exception as e:
            self.failed = f"{type(e).__name__}: {e}"
            logger.warning("CUDA graph capture failed (%s): decoding eagerly from now on", self.failed)
            self.clear()
            return result
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[key] = _Captured(graph, static, out)
        self.capture_seconds += time.perf_counter() - start
        logger.debug("captured the decode graph for %d rows x %d keys", rows, key_len)
        return result

    def clear(self) -> None:
        """Forget every graph, its memory pool and the output buffer (the next steps capture again)."""
        if self._graphs:
            logger.debug("dropping %d decode graphs", len(self._graphs))
        self._graphs.clear()
        self._pool = None
        self._out = None
