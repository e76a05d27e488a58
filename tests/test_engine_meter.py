"""slime.rollout.engine_meter: a step's engine metrics from the counters of /get_server_info.

The CUDA-graph counters exist only on a CUDA engine, so the clients here answer with recorded
`internal_states` (the engine's own server answers with real ones in tests/test_continuous_e2e.py).
"""

from __future__ import annotations

import asyncio

import pytest

from slime.rollout.engine_meter import EngineMeter, metrics


class Recorded:
    """An engine client whose /get_server_info answers the counters set on it (or fails)."""

    def __init__(self, base_url: str, **counters: float):
        self.base_url, self.counters = base_url, counters
        self.down = False

    async def get_server_info(self) -> dict:
        if self.down:
            raise ConnectionError(self.base_url)
        return {"internal_states": [dict(self.counters)]}


def cuda_engine(url: str, busy: float, steps: int, replays: int, capture: float) -> Recorded:
    return Recorded(
        url,
        busy_seconds=busy,
        num_steps=steps,
        cuda_graph_replays=replays,
        cuda_graph_capture_seconds=capture,
    )


def test_a_step_s_metrics_are_the_counters_increase_over_its_time():
    clock = iter([100.0, 110.0, 120.0])
    a, b = cuda_engine("a", 1.0, 10, 8, 0.5), cuda_engine("b", 2.0, 20, 20, 0.0)
    meter = EngineMeter(clock=lambda: next(clock))
    assert asyncio.run(meter.read([a, b])) == {}  # the first read only sets the start
    a.counters.update(busy_seconds=7.0, num_steps=110, cuda_graph_replays=98, cuda_graph_capture_seconds=1.5)
    b.counters.update(busy_seconds=5.0, num_steps=120, cuda_graph_replays=80, cuda_graph_capture_seconds=0.25)
    out = asyncio.run(meter.read([a, b]))
    assert out["time/engine_busy_share"] == pytest.approx((0.6 + 0.3) / 2)
    assert out["perf/engine_cuda_graph_capture_time"] == pytest.approx(1.25)
    assert out["perf/engine_cuda_graph_replay_share"] == pytest.approx((90 + 60) / 200)

    # b restarted (its counters went down) and a is down: nothing from either this time
    a.down = True
    b.counters.update(busy_seconds=0.5, num_steps=3, cuda_graph_replays=0, cuda_graph_capture_seconds=0.1)
    assert asyncio.run(meter.read([a, b])) == {}


def test_an_engine_without_graphs_gives_its_busy_share_alone_and_sglang_nothing():
    cpu = {"busy_seconds": 4.0, "num_steps": 50}
    assert metrics([cpu], 8.0) == {"time/engine_busy_share": 0.5}
    assert metrics([{}], 8.0) == {}
    # a graph-replaying engine that took no step: its capture time, no share
    idle = {"busy_seconds": 0.0, "num_steps": 0, "cuda_graph_replays": 0, "cuda_graph_capture_seconds": 0.0}
    assert metrics([idle], 8.0) == {"time/engine_busy_share": 0.0, "perf/engine_cuda_graph_capture_time": 0.0}
