"""The torch engine's observability over real HTTP on loopback: `GET /metrics` in Prometheus' text
format under SGLang's metric names and labels (counters equal to what was generated, histograms
counting the requests, gauges following the requests in flight, the API key, one registry per
engine), and SGLang's per-request timing fields in /generate's meta_info."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from slime.engines.protocol import new_api_key
from slime.engines.torch_engine.cli import bind_socket
from slime.engines.torch_engine.metrics import SpreadHistogram, ThroughputWindow
from slime.engines.torch_engine.server import make_app
from tests.inprocess import InProcessServer

Metrics = dict[str, list[Any]]  # sample name -> its samples


def parse(text: str) -> Metrics:
    samples: Metrics = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(metrics: Metrics, name: str, **labels: str) -> float:
    """The one sample `name` (with these labels among its own)."""
    found = [s.value for s in metrics[name] if labels.items() <= s.labels.items()]
    assert len(found) == 1, (name, labels, metrics.get(name))
    return found[0]


async def scrape(http: aiohttp.ClientSession, url: str, headers: dict[str, str] | None = None) -> Metrics:
    async with http.get(url + "/metrics", headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"] == CONTENT_TYPE_LATEST
        return parse(await resp.text())


async def post(http: aiohttp.ClientSession, url: str, path: str, body: Any) -> Any:
    async with http.post(url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def scrape_until(
    http, url: str, condition: Callable[[Metrics], bool], timeout_s: float = 30.0
) -> Metrics:
    """Scrape until `condition` holds (the engine thread gets there on its own time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = await scrape(http, url)
        if condition(metrics):
            return metrics
        assert time.monotonic() < deadline, "the engine never got there"
        await asyncio.sleep(0.01)


def generate(tokens: int, prompt: list[int] | list[list[int]]) -> dict[str, Any]:
    return {"input_ids": prompt, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}


IDLE_GAUGES = (
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
    "sglang:num_used_tokens",
    "sglang:token_usage",
)


def test_counters_and_histograms_equal_the_requests_answered(tiny_model):
    with InProcessServer(tiny_model, max_running_requests=8) as server:

        async def scenario() -> tuple[list[dict], Metrics]:
            async with aiohttp.ClientSession() as http:
                singles = [
                    post(http, server.url, "/generate", generate(n, list(range(1, 2 + n)))) for n in (1, 3, 7)
                ]
                batch = post(http, server.url, "/generate", generate(5, [[4, 5], [6, 7, 8]]))
                answers = await asyncio.gather(*singles, batch)
                async with http.get(server.url + "/health_generate") as resp:  # not a request to count
                    assert resp.status == 200
                return [*answers[:3], *answers[3]], await scrape(http, server.url)

        answers, metrics = asyncio.run(scenario())
    metas = [a["meta_info"] for a in answers]
    prompted = sum(m["prompt_tokens"] for m in metas)
    generated = sum(len(a["output_ids"]) for a in answers)
    assert (prompted, generated) == (2 + 4 + 8 + 2 + 3, 1 + 3 + 7 + 5 + 5)
    labels = {"model_name": tiny_model, "engine_type": "unified"}
    assert value(metrics, "sglang:prompt_tokens_total", **labels) == prompted
    assert value(metrics, "sglang:generation_tokens_total", **labels) == generated
    assert value(metrics, "sglang:num_requests_total", **labels) == len(answers) == 5
    assert value(metrics, "sglang:num_aborted_requests_total", **labels) == 0
    for name in ("time_to_first_token", "e2e_request_latency", "queue_time"):
        assert value(metrics, f"sglang:{name}_seconds_count", **labels) == 5, name
        assert value(metrics, f"sglang:{name}_seconds_bucket", le="+Inf") == 5, name
    # The histogram books the e2e_latency each answer carries.
    assert value(metrics, "sglang:e2e_request_latency_seconds_sum") == pytest.approx(
        sum(m["e2e_latency"] for m in metas)
    )
    # One inter-token interval per token after a request's first; their sum, each decode phase.
    assert value(metrics, "sglang:inter_token_latency_seconds_count", **labels) == generated - 5
    decoding = sum(
        (m["completion_tokens"] - 1) / m["decode_throughput"] for m in metas if "decode_throughput" in m
    )
    assert value(metrics, "sglang:inter_token_latency_seconds_sum") == pytest.approx(decoding)
    # Idle again: the engine-state gauges, with SGLang's scheduler labels.
    engine_labels = {**labels, "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
    for name in IDLE_GAUGES:
        assert value(metrics, name, **engine_labels) == 0, name
    capacity = value(metrics, "sglang:max_total_num_tokens", **engine_labels)
    assert capacity == 8 * server.engine.context_length
    throughput = value(metrics, "sglang:gen_throughput", **engine_labels)
    assert math.isfinite(throughput) and throughput >= 0


def test_gauges_follow_the_requests_in_flight(tiny_model):
    """Paused, two requests wait in the queue; one engine step (run on the engine thread, as the
    loop would) admits both; once they finish, every gauge is back at 0."""
    with InProcessServer(tiny_model) as server:
        engine, url = server.engine, server.url

        async def scenario() -> None:
            async with aiohttp.ClientSession() as http:
                await post(http, url, "/pause_generation", {"mode": "in_place"})
                prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
                tasks = [asyncio.create_task(post(http, url, "/generate", generate(4, p))) for p in prompts]
                queued = await scrape_until(http, url, lambda m: value(m, "sglang:num_queue_reqs") == 2)
                assert value(queued, "sglang:num_running_reqs") == 0
                assert value(queued, "sglang:num_used_tokens") == 0

                await asyncio.wrap_future(engine.call(engine._step))  # one prefill: both admitted
                running = await scrape(http, url)
                assert value(running, "sglang:num_running_reqs") == 2
                assert value(running, "sglang:num_queue_reqs") == 0
                assert value(running, "sglang:num_used_tokens") == 3 + 5  # the prompts' KV positions
                capacity = value(running, "sglang:max_total_num_tokens")
                assert value(running, "sglang:token_usage") == pytest.approx(8 / capacity)
                assert value(running, "sglang:num_requests_total") == 0  # none has finished

                await post(http, url, "/continue_generation", {})
                answers = await asyncio.gather(*tasks)
                assert [len(a["output_ids"]) for a in answers] == [4, 4]
                done = await scrape(http, url)
                for name in IDLE_GAUGES:
                    assert value(done, name) == 0, name
                assert value(done, "sglang:num_requests_total") == 2
                # They waited in the queue for the whole pause: both queue times are booked.
                assert value(done, "sglang:queue_time_seconds_count") == 2
                assert all(a["meta_info"]["queue_time"] > 0 for a in answers)

        asyncio.run(scenario())


def test_timing_fields_of_meta_info(tiny_model):
    """SGLang's timing fields: ordered as the request went (queue <= first token <= answer),
    non-negative; an aborted request that never ran has waited and nothing else."""
    with InProcessServer(tiny_model) as server:
        url = server.url

        async def scenario() -> tuple[list[dict], dict, Metrics]:
            async with aiohttp.ClientSession() as http:
                answers = [await post(http, url, "/generate", generate(n, [1, 2, 3])) for n in (0, 1, 6)]
                await post(http, url, "/pause_generation", {"mode": "in_place"})
                waiting = asyncio.create_task(post(http, url, "/generate", generate(4, [5, 6])))
                await scrape_until(http, url, lambda m: value(m, "sglang:num_queue_reqs") == 1)
                await post(http, url, "/abort_request", {"abort_all": True})
                aborted = await waiting
                await post(http, url, "/continue_generation", {})
                return answers, aborted, await scrape(http, url)

        answers, aborted, metrics = asyncio.run(scenario())
    # The stamps are Unix seconds (about 2e-7 s apart at today's dates): compare within 1e-6.
    eps = 1e-6
    for answer in [*answers, aborted]:
        meta = answer["meta_info"]
        durations = [meta[k] for k in ("queue_time", "inference_time", "e2e_latency")]
        assert all(d >= 0 for d in durations), meta
        assert meta["queue_time"] <= meta["e2e_latency"] and meta["inference_time"] <= meta["e2e_latency"]
        assert meta["request_received_ts"] <= meta["request_finished_ts"] <= time.time()
        assert meta["request_finished_ts"] - meta["request_received_ts"] == pytest.approx(
            meta["e2e_latency"], abs=eps
        )
    empty, one, six = (a["meta_info"] for a in answers)
    for meta in (one, six):
        ttft = meta["prefill_finished_time"] - meta["request_received_ts"]
        assert 0 <= meta["queue_time"] <= ttft + eps and ttft <= meta["e2e_latency"] + eps
        assert meta["request_received_ts"] <= meta["forward_entry_time"] + eps
        assert meta["forward_entry_time"] <= meta["prefill_finished_time"] <= meta["request_finished_ts"]
    assert "decode_throughput" not in one  # nothing decoded after the first token
    assert six["decode_throughput"] > 0
    for meta in (empty, aborted["meta_info"]):  # never prefilled: no stamps of a forward
        assert "forward_entry_time" not in meta and "prefill_finished_time" not in meta
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert aborted["meta_info"]["queue_time"] > 0  # it waited until the abort
    assert value(metrics, "sglang:num_requests_total") == 4
    assert value(metrics, "sglang:num_aborted_requests_total") == 1
    assert value(metrics, "sglang:time_to_first_token_seconds_count") == 2  # the two with a token
    assert value(metrics, "sglang:e2e_request_latency_seconds_count") == 4


class KeyedServer(InProcessServer):
    """An in-process engine whose HTTP front requires `api_key`."""

    def __init__(self, model_path: str, api_key: str):
        super().__init__(model_path)
        self.api_key = api_key

    async def _start(self) -> str:
        app = make_app(self.engine, api_key=self.api_key)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self.runner.setup()
        sock = bind_socket("127.0.0.1", 0)
        await web.SockSite(self.runner, sock).start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_metrics_need_the_api_key(tiny_model):
    key = new_api_key()
    with KeyedServer(tiny_model, key) as server:

        async def scenario() -> None:
            async with aiohttp.ClientSession() as http:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {key}"}):
                    async with http.get(server.url + "/metrics", headers=headers) as resp:
                        assert resp.status == 401, headers
                        assert key not in await resp.text()
                metrics = await scrape(http, server.url, {"Authorization": f"Bearer {key}"})
                assert value(metrics, "sglang:num_requests_total") == 0

        asyncio.run(scenario())


def test_each_engine_counts_its_own_requests(tiny_model):
    """Two engines in one process: a registry each, no counter shared."""
    with InProcessServer(tiny_model) as first, InProcessServer(tiny_model) as second:
        assert first.engine.metrics.registry is not second.engine.metrics.registry

        async def scenario() -> tuple[Metrics, Metrics]:
            async with aiohttp.ClientSession() as http:
                await post(http, first.url, "/generate", generate(3, [1, 2]))
                return await scrape(http, first.url), await scrape(http, second.url)

        one, other = asyncio.run(scenario())
    assert (value(one, "sglang:num_requests_total"), value(one, "sglang:generation_tokens_total")) == (1, 3)
    assert (value(other, "sglang:num_requests_total"), value(other, "sglang:generation_tokens_total")) == (
        0,
        0,
    )


def test_spread_histogram_books_a_request_at_once():
    """n intervals of a request land in the bucket of their mean: count n, sum their total."""
    hist = SpreadHistogram("x_seconds", "x", {"model_name": "m"}, (0.01, 0.1, 1.0))
    hist.observe_spread(0.15, 3)  # 3 intervals of 0.05 s
    hist.observe_spread(0.01, 1)  # on a bound: le is inclusive
    hist.observe_spread(5.0, 2)  # past the last bound
    hist.observe_spread(1.0, 0)  # a one-token request has no interval
    (family,) = hist.collect()
    buckets = {s.labels["le"]: s.value for s in family.samples if s.name == "x_seconds_bucket"}
    assert buckets == {"0.01": 1, "0.1": 4, "1.0": 4, "+Inf": 6}
    totals = {s.name: s.value for s in family.samples if s.name != "x_seconds_bucket"}
    assert totals["x_seconds_count"] == 6 and totals["x_seconds_sum"] == pytest.approx(5.16)


def test_throughput_window_measures_the_last_seconds():
    window = ThroughputWindow(10.0, now=0.0)
    assert window.rate(0.0, 0) == 0.0
    assert window.rate(2.0, 100) == 50.0  # younger than the window: since the start
    for t in range(1, 31):  # 10 tokens a second for 30 s, sampled every second
        window.sample(float(t), 10 * t)
    assert window.rate(30.5, 305) == pytest.approx(105 / 10.5)  # from the sample at t = 20
    for t in range(31, 45):  # idle for 14 s
        window.sample(float(t), 300)
    assert window.rate(45.0, 300) == 0.0
