"""What the torch engines did between two reads (one train step to the next), from the counters
their /get_server_info reports (`internal_states[0]`): the share of the wall time spent in forward
steps and, on CUDA, the seconds spent capturing decode graphs and the share of the forward steps
(prefills included, which never replay) replayed from one. SGLang reports none of these counters:
no metric then.

A decode graph holds on to the KV cache, so the engines capture their graphs again after every
memory release (a colocated job's every step) and whenever the cache grows; the capture seconds
show what that costs, and a replay share well below 1 that decode steps run eagerly (a batch over
--cuda-graph-max-bs, or a capture that failed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

COUNTERS = ("busy_seconds", "num_steps", "cuda_graph_replays", "cuda_graph_capture_seconds")


class EngineMeter:
    """Reads the engines' counters; each read returns the metrics of the time since the last."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.last: tuple[float, dict[str, dict[str, float]]] | None = None

    async def read(self, clients: list[Any]) -> dict[str, float]:
        """`clients`: slime.engines.client.EngineClient (each base_url names its engine)."""
        now = self.clock()
        counters: dict[str, dict[str, float]] = {}
        for c in clients:
            try:
                state = (await c.get_server_info())["internal_states"][0]
                counters[c.base_url] = {k: float(state[k]) for k in COUNTERS if k in state}
            except Exception:  # an engine without the counters, or down: nothing from it
                continue
        last, self.last = self.last, (now, counters)
        if last is None or now <= last[0]:
            return {}
        deltas = [_delta(new, last[1][url]) for url, new in counters.items() if url in last[1]]
        return metrics([d for d in deltas if d is not None], now - last[0])


def _delta(new: dict[str, float], old: dict[str, float]) -> dict[str, float] | None:
    """The counters' increase; None where one went down (the engine restarted since)."""
    delta = {k: new[k] - old[k] for k in new if k in old}
    return None if any(v < 0 for v in delta.values()) else delta


def metrics(deltas: list[dict[str, float]], seconds: float) -> dict[str, float]:
    """The step's metrics from each engine's counter increases over `seconds` of wall time."""
    out: dict[str, float] = {}
    busy = [d["busy_seconds"] for d in deltas if "busy_seconds" in d]
    if busy:
        out["time/engine_busy_share"] = min(1.0, sum(busy) / len(busy) / seconds)
    graphs = [d for d in deltas if "cuda_graph_replays" in d and "num_steps" in d]
    if graphs:
        out["perf/engine_cuda_graph_capture_time"] = sum(
            d.get("cuda_graph_capture_seconds", 0.0) for d in graphs
        )
        steps = sum(d["num_steps"] for d in graphs)
        if steps:
            # (a round's replays count when it is launched, its steps when booked: capped at 1)
            replays = sum(d["cuda_graph_replays"] for d in graphs)
            out["perf/engine_cuda_graph_replay_share"] = min(1.0, replays / steps)
    return out
