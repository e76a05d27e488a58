"""Engine health in-process (--use-fault-tolerance): the monitor's rounds against a real torch
engine and an address where nothing answers, its pause and resume, and a rollout whose engine is
marked down mid-group or whose only engine is down until a replacement arrives."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import pytest

from slime.config.rollout import DataConfig, SamplingConfig
from slime.engines.client import ClientConfig, EngineClient
from slime.rollout.builtin_rollout import RolloutGenerator
from slime.rollout.data import PromptDataset
from slime.rollout.health import EngineHealth, HealthMonitor
from slime.rollout.rewards import RewardModel
from slime.utils.net import free_port


def wait_until(condition, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_the_monitor_marks_down_an_engine_that_does_not_answer(engine, caplog):
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    health = EngineHealth([engine.url, dead])
    with caplog.at_level(logging.WARNING):
        monitor = HealthMonitor(health, interval_s=0.1, timeout_s=5.0)
        try:
            wait_until(lambda: monitor.rounds >= 2)
        finally:
            monitor.stop()
    assert health.down() == {1: "/health_generate did not answer 200 within 5 s"}
    assert health.live() == [engine.url]
    # Each round ran (the old monitor gathered its coroutines outside any event loop and failed).
    assert "health check round failed" not in caplog.text


def test_a_paused_monitor_checks_nothing_and_waits_first_after_a_resume(engine):
    health = EngineHealth([engine.url])
    monitor = HealthMonitor(health, interval_s=0.05, timeout_s=5.0, first_wait_s=0.0)
    try:
        wait_until(lambda: monitor.rounds >= 1)
        monitor.pause()  # returns once no round runs
        paused_at = monitor.rounds
        time.sleep(0.5)
        assert monitor.rounds == paused_at
        monitor.first_wait_s = 0.6
        monitor.resume()
        resumed = time.monotonic()
        wait_until(lambda: monitor.rounds > paused_at)
        assert time.monotonic() - resumed >= 0.6
    finally:
        monitor.stop()
    assert health.down() == {}


@pytest.fixture
def silent_url():
    """An address that accepts connections and never answers (an engine that hangs)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()


def rollout(urls, health, tokenizer, tmp_path, prompts=2):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "label": str(i + 1)}) + "\n" for i in range(8)))

    async def go():
        clients = [EngineClient(u, ClientConfig(timeout_s=120.0, max_retries=0)) for u in urls]
        try:
            gen = RolloutGenerator(
                PromptDataset(DataConfig(str(path)), tokenizer),
                clients,
                RewardModel("exact", None, False, None),
                SamplingConfig(n_samples_per_prompt=2, max_response_len=4),
                prompts,
                health=health,
            )
            return await gen.generate_rollout()
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    return asyncio.run(go())


def test_a_group_whose_engine_is_marked_down_is_generated_again_elsewhere(
    engine, silent_url, tokenizer, tmp_path
):
    health = EngineHealth([silent_url, engine.url])
    # The first group goes to the silent engine and hangs there until the monitor (here: this
    # thread) marks it down; then it is cancelled and generated again on the live engine.
    marker = threading.Timer(1.0, health.mark_down, (silent_url, "/health_generate did not answer"))
    marker.start()
    result = rollout([silent_url, engine.url], health, tokenizer, tmp_path)
    marker.join()
    assert sorted(s.group_index for s in result.samples) == [0, 0, 1, 1]
    assert sorted(s.metadata["prompt_index"] for s in result.samples) == [0, 0, 1, 1]
    assert all(s.response_length > 0 for s in result.samples)
    assert health.down() == {0: "/health_generate did not answer"}


def test_with_every_engine_down_the_rollout_waits_for_a_replacement(engine, tokenizer, tmp_path):
    dead = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    health = EngineHealth([dead])
    health.mark_down(dead, "killed")
    replacer = threading.Timer(1.0, health.replace, (0, engine.url))
    replacer.start()
    started = time.monotonic()
    result = rollout([dead], health, tokenizer, tmp_path)
    replacer.join()
    assert time.monotonic() - started >= 1.0
    assert sorted(s.group_index for s in result.samples) == [0, 0, 1, 1]
    assert health.live() == [engine.url] and health.down() == {}
