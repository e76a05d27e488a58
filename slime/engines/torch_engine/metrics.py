"""Prometheus metrics of one torch engine (`GET /metrics`), under SGLang's names, types and labels
where the meaning is the same, so dashboards and alerts written for SGLang servers read ours.

Each engine has its own `CollectorRegistry` (two engines in one process share nothing). Nothing
here runs per token or per decode step:

* the gauges (running and queued requests, KV tokens, throughput) are read at scrape time from
  `TorchEngine.current_load()`, without a lock on the engine thread;
* the counters and histograms are updated once per finished request, from its `RequestTimes`
  (slime.engines.torch_engine.sequence), on the engine thread, by the HTTP front's finish callback;
* `sglang:gen_throughput` comes from samples of the engine's generated-token count that the HTTP
  front takes once a second (`sample_throughput`).

Labels as SGLang's: the request metrics (its tokenizer manager's) carry `model_name` and
`engine_type`; the engine-state metrics (its scheduler's) add `tp_rank`, `pp_rank`, `moe_ep_rank`.
`model_name` is the served model path (SGLang's `--served-model-name` defaults to it); this engine
is one unified (not prefill/decode-disaggregated) rank: `engine_type="unified"`, ranks `"0"`.
docs/observability.md lists the metrics and what each measures here.
"""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from slime.engines.torch_engine.scheduler import Scheduler
    from slime.engines.torch_engine.sequence import Sequence


def _bounds(text: str) -> tuple[float, ...]:
    return tuple(float(b) for b in text.split())


# SGLang's default buckets (its TokenizerMetricsCollector's and SchedulerMetricsCollector's).
TIME_TO_FIRST_TOKEN_BUCKETS = _bounds("0.1 0.2 0.4 0.6 0.8 1 2 4 6 8 10 20 40 60 80 100 200 400")
E2E_REQUEST_LATENCY_BUCKETS = _bounds(
    "0.1 0.2 0.4 0.6 0.8 1 2 4 6 8 10 20 40 60 80 100 200 400 600 1200 1800 2400"
)
INTER_TOKEN_LATENCY_BUCKETS = _bounds(
    "0.002 0.004 0.006 0.008 0.010 0.015 0.020 0.025 0.030 0.035 0.040 0.060 0.080 0.100 0.200 0.400 "
    "0.600 0.800 1 2 4 6 8"
)
QUEUE_TIME_BUCKETS = _bounds(
    "0 0.1 0.2 0.5 1 2 3 4 5 10 15 20 30 40 50 60 70 80 90 100 200 300 400 500 600 700 800 900 1000 "
    "1200 1400 1600 1800 2000 2500 3000"
)
GEN_THROUGHPUT_WINDOW_S = 10.0
"""`sglang:gen_throughput` counts the tokens generated over about this many seconds before a scrape."""


@dataclass(frozen=True)
class EngineLoad:
    """What an engine holds at one moment (slime.engines.torch_engine.engine.TorchEngine.current_load)."""

    num_running_reqs: int
    """Requests admitted to the running batch (they hold KV state or are about to)."""
    num_queue_reqs: int
    """Requests waiting to be admitted (new, or retracted by a `retract` pause)."""
    num_used_tokens: int
    """KV positions holding a running request's keys and values."""
    max_total_num_tokens: int
    """The KV slots the cache may hold: `max_running_requests` rows of `context_length` positions."""
    num_generated_tokens: int
    """Tokens sampled since the engine started (a running total)."""


class ThroughputWindow:
    """Tokens per second over the last `window_s` seconds, from samples of a running total.

    It keeps the samples of the last `window_s` seconds and the newest one before them, the
    base the rate is measured from: so the window spans `window_s` plus at most one sampling
    period (less while the engine is younger than the window). One thread only (the event loop).
    """

    def __init__(self, window_s: float, now: float, total: int = 0):
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque([(now, total)])

    def sample(self, now: float, total: int) -> None:
        self._samples.append((now, total))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def rate(self, now: float, total: int) -> float:
        since, base = self._samples[0]
        return (total - base) / (now - since) if now > since else 0.0


class SpreadHistogram(Collector):
    """A histogram that takes `count` equal observations summing to `total` at once.

    prometheus_client's Histogram observes one value per call; a request's inter-token latency is
    `count` = completion_tokens - 1 intervals, booked once per request (as SGLang books a chunk of
    tokens: their mean interval, weighted by their number) instead of once per token.
    """

    def __init__(self, name: str, documentation: str, labels: dict[str, str], buckets: tuple[float, ...]):
        self.name, self.documentation, self.labels = name, documentation, labels
        self.bounds = (*(float(b) for b in buckets), math.inf)
        self._counts = [0] * len(self.bounds)
        self._sum = 0.0
        self._lock = threading.Lock()  # held for a few list operations: the engine thread books

    def observe_spread(self, total: float, count: int) -> None:
        if count <= 0:
            return
        index = bisect.bisect_left(self.bounds, total / count)  # the first bucket with le >= value
        with self._lock:
            self._counts[index] += count
            self._sum += total

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self.name, self.documentation, labels=list(self.labels))
        cumulative = itertools.accumulate(counts)
        buckets = [(floatToGoString(bound), n) for bound, n in zip(self.bounds, cumulative)]
        family.add_metric(list(self.labels.values()), buckets, sum_value=total)
        yield family


class _LoadGauges(Collector):
    """The engine-state gauges, read when Prometheus scrapes."""

    def __init__(self, labels: dict[str, str], load: Callable[[], EngineLoad], throughput: ThroughputWindow):
        self.labels, self.load, self.throughput = labels, load, throughput

    def collect(self) -> Iterator[Metric]:
        load = self.load()
        capacity = load.max_total_num_tokens
        usage = load.num_used_tokens / capacity if capacity else 0.0
        throughput = self.throughput.rate(time.perf_counter(), load.num_generated_tokens)
        window = self.throughput.window_s
        values = [
            ("sglang:num_running_reqs", "Requests in the running batch.", load.num_running_reqs),
            ("sglang:num_queue_reqs", "Requests waiting to be admitted.", load.num_queue_reqs),
            ("sglang:num_used_tokens", "KV cache positions running requests hold.", load.num_used_tokens),
            ("sglang:max_total_num_tokens", "KV cache positions the engine may hold.", capacity),
            ("sglang:token_usage", "num_used_tokens / max_total_num_tokens.", usage),
            ("sglang:gen_throughput", f"Tokens generated per second over ~{window:g} s.", throughput),
        ]
        for name, documentation, value in values:
            family = GaugeMetricFamily(name, documentation, labels=list(self.labels))
            family.add_metric(list(self.labels.values()), float(value))
            yield family


class EngineMetrics:
    """One engine's metrics and their registry.

    Args:
        model_name: the `model_name` label (the served model path).
        load: reads the engine's state (TorchEngine.current_load), from the scraping thread.
    """

    def __init__(self, model_name: str, load: Callable[[], EngineLoad]):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine_type": "unified"}
        engine_labels = {**labels, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        self.throughput = ThroughputWindow(GEN_THROUGHPUT_WINDOW_S, time.perf_counter())
        self.registry.register(_LoadGauges(engine_labels, load, self.throughput))

        def counter(name: str, documentation: str) -> Counter:
            return Counter(name, documentation, list(labels), registry=self.registry).labels(**labels)

        def histogram(
            name: str, documentation: str, buckets: tuple[float, ...], on: dict[str, str]
        ) -> Histogram:
            family = Histogram(name, documentation, list(on), registry=self.registry, buckets=buckets)
            return family.labels(**on)

        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Prompt tokens of the finished requests.")
        self.generation_tokens = counter(
            "sglang:generation_tokens_total", "Output tokens of the finished requests."
        )
        self.num_requests = counter("sglang:num_requests_total", "Finished requests (aborted ones included).")
        self.num_aborted = counter("sglang:num_aborted_requests_total", "Requests that finished aborted.")
        self.time_to_first_token = histogram(
            "sglang:time_to_first_token_seconds",
            "From receiving a request to sampling its first token, in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
            labels,
        )
        self.e2e_request_latency = histogram(
            "sglang:e2e_request_latency_seconds",
            "From receiving a request to its answer, in seconds.",
            E2E_REQUEST_LATENCY_BUCKETS,
            labels,
        )
        self.queue_time = histogram(
            "sglang:queue_time_seconds",
            "From entering the waiting queue to the first prefill, in seconds.",
            QUEUE_TIME_BUCKETS,
            engine_labels,
        )
        self.inter_token_latency = SpreadHistogram(
            "sglang:inter_token_latency_seconds",
            "Time between two output tokens of a request, in seconds (one sample per token after the first).",
            labels,
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.registry.register(self.inter_token_latency)

    def observe_finished(self, seq: Sequence) -> None:
        """Book one answered request (engine thread; a few lock-guarded additions)."""
        times = seq.times
        completion_tokens = len(seq.output_ids)
        self.prompt_tokens.inc(seq.num_prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.num_requests.inc()
        if seq.finish_reason is not None and seq.finish_reason.type == "abort":
            self.num_aborted.inc()
        self.e2e_request_latency.observe(times.responded - times.created)
        if times.admitted:
            self.queue_time.observe(times.admitted - times.queued)
        if times.first_token:
            self.time_to_first_token.observe(times.first_token - times.created)
            self.inter_token_latency.observe_spread(times.finished - times.first_token, completion_tokens - 1)

    def sample_throughput(self, num_generated_tokens: int) -> None:
        """Record the engine's generated-token total now (the event loop, once a second)."""
        self.throughput.sample(time.perf_counter(), num_generated_tokens)

    def render(self) -> bytes:
        """The text exposition of every metric (on the event loop: it shares `throughput`)."""
        return generate_latest(self.registry)


class EngineTimeline:
    """The engine's row of the job's timeline (--trace-dir; slime.utils.job_trace): its
    state as spans (busy, paused, memory released; idle is the gaps) and its running and queued
    requests as a counter, looked at once per turn of the engine thread (nothing when the
    process does not record)."""

    COUNTER_INTERVAL_NS = 10_000_000
    """A busy engine's request counts are recorded at most every 10 ms (a count that comes to or
    leaves 0 at once)."""

    def __init__(self) -> None:
        from slime.utils.job_trace import RECORDER, StateRow

        self.recorder = RECORDER
        self.row = StateRow("scheduler")

    def look(self, paused: bool, released: bool, scheduler: Scheduler) -> None:
        """`paused`: generation paused; `released`: the memory released."""
        if not self.recorder.enabled:
            return
        busy = "busy" if scheduler.has_work() else "idle"
        self.row.set("paused" if paused else "memory released" if released else busy)
        counts = {"running": len(scheduler.running), "queued": len(scheduler.waiting)}
        self.recorder.counter("requests", counts, "scheduler", self.COUNTER_INTERVAL_NS)

    def cut(self) -> None:
        """On the engine thread, before a drain: the state it is in so far, as a span."""
        self.row.cut()
