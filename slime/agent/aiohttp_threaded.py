"""An aiohttp application served from a daemon thread of its own (the adapters' server beside a
rollout's event loop)."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_log import AccessLogger


class FilteredAccessLogger(AccessLogger):
    """An access log of what needs a look: errors and slow requests (HEAD and quick 200s are not
    logged: an agent run makes thousands)."""

    SLOW_THRESHOLD_SEC = 120.0

    def log(self, request: Any, response: Any, time: float) -> None:
        if request.method == "HEAD" or (response.status == 200 and time <= self.SLOW_THRESHOLD_SEC):
            return
        super().log(request, response, time)


@dataclass
class AppHandle:
    """A running app: where it listens, and `stop()`."""

    host: str
    port: int
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    runner: web.AppRunner

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close the app (its cleanup hooks run) and end the thread."""
        if not self.thread.is_alive():
            return
        try:
            asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(timeout_s)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout_s)


def run_app_in_thread(
    app: web.Application,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    thread_name: str = "aiohttp-app",
    start_timeout_sec: float = 15.0,
    runner_kwargs: dict[str, Any] | None = None,
) -> AppHandle:
    """Serve `app` from a new daemon thread and return once it listens (port 0: a free one).
    `runner_kwargs` go to web.AppRunner (`handler_cancellation=True`: a client that disconnects
    cancels its handler). The default host is loopback; slime's is 0.0.0.0."""
    ready = threading.Event()
    box: dict[str, Any] = {}

    def serve() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            runner = web.AppRunner(app, **(runner_kwargs or {}))
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, host, port)
            loop.run_until_complete(site.start())
            sockets = getattr(site._server, "sockets", None) or []  # the port a port of 0 became
            box.update(loop=loop, runner=runner, port=sockets[0].getsockname()[1] if sockets else port)
        except BaseException as e:
            box["error"] = e
            ready.set()
            loop.close()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    thread = threading.Thread(target=serve, name=thread_name, daemon=True)
    thread.start()
    if not ready.wait(start_timeout_sec):
        raise TimeoutError(
            f"{thread_name}: the app did not start listening on {host}:{port} in {start_timeout_sec} s"
        )
    if "error" in box:
        raise box["error"]
    return AppHandle(host, int(box["port"]), thread, box["loop"], box["runner"])
