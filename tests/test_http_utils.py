"""slime.utils.http_utils against a real aiohttp server on loopback."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from slime.utils import http_utils


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


def test_post_retries_then_returns_json_or_text(monkeypatch):
    monkeypatch.setattr(http_utils, "RETRY_INTERVAL_S", 0.01)
    calls = {"n": 0}

    async def flaky(request: web.Request) -> web.Response:
        calls["n"] += 1
        if calls["n"] < 3:
            return web.Response(status=503, text="warming up")
        return web.json_response({"echo": await request.json(), "auth": request.headers.get("Authorization")})

    async def text(request: web.Request) -> web.Response:
        return web.Response(text="plain")

    async def main():
        app = web.Application()
        app.router.add_post("/generate", flaky)
        app.router.add_post("/text", text)
        app.router.add_get("/info", lambda r: web.json_response({"ok": True}))
        runner, url = await serve(app)
        try:
            out = await http_utils.post(f"{url}/generate", {"x": 1}, headers={"Authorization": "Bearer k"})
            assert out == {"echo": {"x": 1}, "auth": "Bearer k"} and calls["n"] == 3
            assert await http_utils.post(f"{url}/text", None) == "plain"
            assert await http_utils.get(f"{url}/info") == {"ok": True}
            calls["n"] = -10
            with pytest.raises(aiohttp.ClientResponseError, match="warming up"):
                await http_utils.post(f"{url}/generate", {}, max_retries=2)
        finally:
            await runner.cleanup()

    asyncio.run(main())


def test_the_engines_key_goes_to_registered_addresses_only(monkeypatch):
    monkeypatch.setattr(http_utils, "_credentials", {})

    async def echo(request: web.Request) -> web.Response:
        return web.json_response({"auth": request.headers.get("Authorization")})

    async def main():
        apps = []
        for _ in range(2):
            app = web.Application()
            app.router.add_post("/generate", echo)
            app.router.add_get("/workers", echo)
            apps.append(await serve(app))
        (r1, engine), (r2, other) = apps
        try:
            http_utils.register_credentials([other], "old")
            http_utils.register_credentials([engine + "/"], "k1")  # replaces: `other` is forgotten
            assert await http_utils.post(f"{engine}/generate", {}) == {"auth": "Bearer k1"}
            assert await http_utils.get(f"{engine}/workers") == {"auth": "Bearer k1"}
            assert await http_utils.post(f"{other}/generate", {}) == {"auth": None}
            mine = {"Authorization": "Bearer mine"}  # a caller's own header wins
            assert await http_utils.post(f"{engine}/generate", {}, headers=mine) == {"auth": "Bearer mine"}
            http_utils.register_credentials([engine], None)  # no key: nothing registered
            assert await http_utils.post(f"{engine}/generate", {}) == {"auth": None}
        finally:
            await r1.cleanup()
            await r2.cleanup()

    asyncio.run(main())
