"""The router's life beside the engines it fronts: started (or found running) once the engines
answer, every engine registered with it, a restarted engine swapped in, a router that died
started again with the live engines, and at the end stopped (or, one slime did not start, left
running without the engines slime registered).

The rollout manager holds one `RouterFront` (slime.ray.rollout_manager); the router process
itself is slime.engines.router.Router.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from slime.engines.router import Router

logger = logging.getLogger(__name__)


class RouterFront:
    """`backend`: --rollout-backend (a router is started for sglang); `given`: the address of
    --sglang-router-ip/port, or None; `host()`: the address a started router binds (the node's);
    `log_path`: its log; `api_key`: the engines' key, which the router requires too."""

    def __init__(
        self,
        backend: str,
        given: tuple[str, int] | None,
        host: Callable[[], str],
        log_path: str,
        api_key: str | None = None,
    ):
        self.backend, self.given, self.host = backend, given, host
        self.log_path, self.api_key = log_path, api_key
        self.router: Router | None = None
        self.registered: list[str] = []
        """The engines slime added to the router (removed again from a router it did not start)."""
        # The health monitor restarts the router while the driver replaces engines; a holder of
        # `lock` also publishes the new address under it (re-entrant: the methods take it too).
        self.lock = threading.RLock()

    @property
    def url(self) -> str | None:
        return self.router.url if self.router is not None else None

    def start(self, engine_urls: list[str]) -> Router | None:
        """The router for `engine_urls`: started for --rollout-backend sglang, or the one
        --sglang-router-ip/port name; every engine is registered with it. None: no router (torch
        engines without --sglang-router-ip)."""
        if not engine_urls or (self.backend != "sglang" and self.given is None):
            return None
        if self.given is not None:
            router, listed = Router.running(*self.given, api_key=self.api_key)
        else:
            router = self._launch()
            listed = router.workers()
        for url in engine_urls:
            if url not in listed:
                router.add_worker(url)
                self.registered.append(url)
        logger.info("router %s in front of engines %s", router.url, ", ".join(engine_urls))
        self.router = router
        return router

    def _launch(self, port: int | None = None) -> Router:
        return Router.start(self.host(), self.log_path, api_key=self.api_key, port=port)

    def restart_if_dead(self, live: Callable[[], list[str]]) -> bool:
        """--use-fault-tolerance: a router slime started that died is started again, on the same
        port when it is free, with the `live()` engines registered. True when it was restarted
        (its address may have changed)."""
        with self.lock:
            router = self.router
            if router is None or router.proc is None or router.proc.poll() is None:
                return False
            logger.error(
                "the sglang-router at %s exited with code %s; starting it again",
                router.url,
                router.proc.returncode,
            )
            try:
                new = self._launch(router.port)
            except Exception as e:  # the port was taken meanwhile
                logger.warning("restarting the router on port %d: %s; taking a free port", router.port, e)
                new = self._launch()
            engines = live()
            for url in engines:
                new.add_worker(url)
            self.registered, self.router = engines, new
            logger.warning("router restarted at %s with engines %s", new.url, ", ".join(engines))
            return True

    def swap(self, old: str, url: str) -> None:
        """A restarted engine at `url` takes the place of the one at `old` (a dead router is
        left to restart_if_dead, which registers the live engines)."""
        with self.lock:
            if self.router is None:
                return
            for call, worker in ((self.router.remove_worker, old), (self.router.add_worker, url)):
                try:
                    call(worker)
                except Exception as e:  # a dead router: the monitor starts it again with the live engines
                    logger.warning("router %s: %s %s: %s", self.router.url, call.__name__, worker, e)
            self.registered = [u for u in self.registered if u != old] + [url]

    def close(self) -> None:
        """Stop the router slime started; a router given by --sglang-router-ip keeps running,
        without the engines slime registered there."""
        if self.router is None:
            return
        if self.router.proc is not None:
            self.router.stop()
            return
        for url in self.registered:
            try:
                self.router.remove_worker(url)
            except Exception as e:  # shutting down: the router may be gone
                logger.warning("removing %s from the router: %s", url, e)
