"""Two torch engines behind the sglang-router from PyPI, all on loopback."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import pytest

from slime.engines.client import EngineClient
from slime.utils.net import free_port
from tests.conftest import start_engine

router_mod = pytest.importorskip(
    "sglang_router",
    reason="sglang-router is not installed on this machine "
    "(pip install sglang-router); the router test cannot run",
)


@pytest.fixture(scope="module")
def two_engines(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-logs")
    engines = [start_engine(tiny_model, logs) for _ in range(2)]
    yield engines
    for e in engines:
        e.stop()


async def _listed(client) -> object:
    """The router's answer to GET /workers (or /list_workers before that API); None until it answers."""
    for path in ("/workers", "/list_workers"):
        try:
            return await client.request("GET", path)
        except Exception:
            continue
    return None


def test_generate_through_router(two_engines, tmp_path):
    port = free_port("127.0.0.1")
    log = open(tmp_path / "router.log", "wb")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",  # not the default 29000, which another test's router may hold
            str(free_port("127.0.0.1")),
            "--policy",
            "round_robin",
            "--worker-urls",
            *[e.url for e in two_engines],
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    async def scenario():
        async with EngineClient(url) as c:
            deadline = time.monotonic() + 90
            # the router adds its --worker-urls in the background, each after its health check:
            # until both are listed, round robin has one worker to choose from
            while True:
                listed = str(await _listed(c))
                if all(e.url in listed for e in two_engines):
                    break
                assert proc.poll() is None and time.monotonic() < deadline, (
                    tmp_path / "router.log"
                ).read_text()[-3000:]
                await asyncio.sleep(0.2)
            while True:
                assert proc.poll() is None, (tmp_path / "router.log").read_text()[-3000:]
                try:
                    return await asyncio.gather(
                        *[
                            c.generate(
                                input_ids=[1, 2, 3, i],
                                sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True},
                                return_logprob=True,
                            )
                            for i in range(8)
                        ]
                    )
                except Exception:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)

    async def steps(engine_url):
        async with EngineClient(engine_url) as c:
            return (await c.get_server_info())["internal_states"][0]["num_generated_tokens"]

    try:
        before = [asyncio.run(steps(e.url)) for e in two_engines]
        results = asyncio.run(scenario())
        after = [asyncio.run(steps(e.url)) for e in two_engines]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        log.close()
    for res in results:
        assert res["meta_info"]["completion_tokens"] == 4
        assert len(res["meta_info"]["output_token_logprobs"]) == 4
    # round robin: both engines served requests
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_routers_slime_starts_run_side_by_side(tmp_path):
    """Two jobs on one machine each start a router: each gets its own metrics port, on its own
    host (sglang-router's default, 0.0.0.0:29000, let only the first one live)."""
    from slime.engines.router import Router

    routers = [Router.start("127.0.0.1", str(tmp_path / f"router{i}.log")) for i in range(2)]
    try:
        assert [r.workers() for r in routers] == [{}, {}]
        assert all(r.proc is not None and r.proc.poll() is None for r in routers)
    finally:
        for r in routers:
            r.stop()
