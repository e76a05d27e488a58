"""A torch engine and its HTTP app in this process, served on loopback from a background thread.

For tests that must reach inside the engine (inject a fault, hold a command) while talking to it
over real HTTP. The app, socket and engine are the ones `python -m slime.engines.torch_engine`
builds; only the process boundary is missing.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from aiohttp import web

from slime.engines.torch_engine.cli import bind_socket
from slime.engines.torch_engine.engine import EngineConfig, TorchEngine
from slime.engines.torch_engine.server import make_app


class InProcessServer:
    """`with InProcessServer(model_path) as s:` gives `s.url`, `s.engine`, `s.loop_thread`."""

    def __init__(self, model_path: str, **config: Any):
        self.engine = TorchEngine(EngineConfig(model_path=model_path, num_threads=1, **config))
        self.loop = asyncio.new_event_loop()
        self.loop_thread = threading.Thread(target=self.loop.run_forever, name="test-http", daemon=True)
        self.url = ""

    def __enter__(self) -> InProcessServer:
        self.engine.start()
        self.loop_thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()
        return self

    async def _start(self) -> str:
        # handler_cancellation: as in the CLI, a client that disconnects cancels its handler.
        self.runner = web.AppRunner(make_app(self.engine), access_log=None, handler_cancellation=True)
        await self.runner.setup()
        sock = bind_socket("127.0.0.1", 0)
        await web.SockSite(self.runner, sock).start()
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join()
        self.engine.shutdown()
        self.loop.close()
