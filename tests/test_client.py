"""The engine client: retries only for connection errors, timeouts, concurrency bound, API key."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from slime.engines.client import ClientConfig, EngineClient, EngineError
from slime.engines.torch_engine.launcher import start_torch_engine
from tests.conftest import ENGINE_ARGS


def run(coro):
    return asyncio.run(coro)


async def _serve(handler, port: int = 0):
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"http://127.0.0.1:{port}"


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_connection_errors_are_retried_until_server_appears():
    port = _unused_port()
    calls = []

    async def handler(request):
        calls.append(request.path)
        return web.json_response({"ok": True})

    async def scenario():
        async def late_start():
            await asyncio.sleep(0.4)
            return await _serve(handler, port)

        starter = asyncio.create_task(late_start())
        async with EngineClient(
            f"http://127.0.0.1:{port}", ClientConfig(max_retries=5, retry_backoff_s=0.2)
        ) as c:
            result = await c.request("GET", "/get_server_info")
        runner, _ = await starter
        await runner.cleanup()
        return result

    assert run(scenario()) == {"ok": True}
    assert calls == ["/get_server_info"]


def test_gives_up_after_bounded_retries():
    async def scenario():
        async with EngineClient(
            f"http://127.0.0.1:{_unused_port()}", ClientConfig(max_retries=2, retry_backoff_s=0.01)
        ) as c:
            await c.get_server_info()

    with pytest.raises(EngineError, match="after 3 attempts"):
        run(scenario())


def test_post_to_a_missing_server_is_retried():
    async def scenario():
        async with EngineClient(
            f"http://127.0.0.1:{_unused_port()}", ClientConfig(max_retries=2, retry_backoff_s=0.01)
        ) as c:
            await c.update_weights_from_disk("/nowhere")

    with pytest.raises(EngineError, match="after 3 attempts"):
        run(scenario())


async def _hang_up_server(connections: list[int]):
    """A server that reads each request and closes the connection without answering."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.parametrize("method,path", [("POST", "/generate"), ("POST", "/update_weights_from_disk")])
def test_post_that_reached_the_server_is_not_resent(method, path):
    connections: list[int] = []

    async def scenario():
        server, url = await _hang_up_server(connections)
        async with server, EngineClient(url, ClientConfig(max_retries=3, retry_backoff_s=0.01)) as c:
            await c.request(method, path, {"model_path": "/x"})

    with pytest.raises(EngineError, match="not retried"):
        run(scenario())
    assert connections == [1]


def test_get_is_retried_after_a_dropped_connection():
    connections: list[int] = []

    async def scenario():
        server, url = await _hang_up_server(connections)
        async with server, EngineClient(url, ClientConfig(max_retries=2, retry_backoff_s=0.01)) as c:
            await c.get_server_info()

    with pytest.raises(EngineError, match="after 3 attempts"):
        run(scenario())
    assert len(connections) >= 3  # aiohttp may also retry an idempotent GET on its own


def test_timeout_is_not_retried():
    calls = []

    async def handler(request):
        calls.append(1)
        await asyncio.sleep(5)
        return web.json_response({})

    async def scenario():
        runner, url = await _serve(handler)
        try:
            async with EngineClient(url, ClientConfig(timeout_s=0.3, max_retries=3)) as c:
                await c.generate([1, 2])
        finally:
            await runner.cleanup()

    with pytest.raises(EngineError, match="timed out"):
        run(scenario())
    assert calls == [1]


def test_http_errors_are_not_retried_and_carry_the_message():
    calls = []

    async def handler(request):
        calls.append(1)
        return web.json_response({"object": "error", "message": "bad thing", "code": 400}, status=400)

    async def scenario():
        runner, url = await _serve(handler)
        try:
            async with EngineClient(url) as c:
                await c.generate([1])
        finally:
            await runner.cleanup()

    with pytest.raises(EngineError) as info:
        run(scenario())
    assert info.value.status == 400 and "bad thing" in str(info.value) and calls == [1]


def test_concurrency_limit():
    state = {"now": 0, "peak": 0}

    async def handler(request):
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(0.05)
        state["now"] -= 1
        return web.json_response({})

    async def scenario():
        runner, url = await _serve(handler)
        try:
            async with EngineClient(url, ClientConfig(max_concurrency=3)) as c:
                await asyncio.gather(*[c.generate([1]) for _ in range(12)])
        finally:
            await runner.cleanup()

    run(scenario())
    assert state["peak"] == 3


def test_api_key_enforced(tiny_model, tmp_path):
    log = str(tmp_path / "engine.log")
    with start_torch_engine(tiny_model, ENGINE_ARGS, log_path=log, api_key="s3cret") as eng:

        async def scenario():
            async with EngineClient(eng.url) as anonymous:
                assert await anonymous.health()  # /health stays open for routers and probes
                with pytest.raises(EngineError) as info:
                    await anonymous.get_server_info()
                assert info.value.status == 401
                with pytest.raises(EngineError):
                    await anonymous.generate([1, 2])
            async with EngineClient(eng.url, ClientConfig(api_key="wrong")) as wrong:
                with pytest.raises(EngineError) as info:
                    await wrong.get_model_info()
                assert info.value.status == 401
            async with EngineClient(eng.url, ClientConfig(api_key="s3cret")) as good:
                res = await good.generate([1, 2], sampling_params={"max_new_tokens": 2})
                return res["meta_info"]["prompt_tokens"]

        assert run(scenario()) == 2
