"""Engine health for the rollout: which engines are down, found by the monitor or by a failed
request, so that a group's samples are generated again on a healthy engine (never lost, never
twice) and the loop can restart the engine before the next weight push.

`--rollout-health-check-interval S` starts `HealthMonitor`: every S seconds each engine must
answer `/health_generate` (a real one-token generation) within `--rollout-health-check-timeout`
seconds, or it is marked down.
"""

from __future__ import annotations

import logging
import threading

from slime.engines.client import EngineError

logger = logging.getLogger(__name__)


def engine_down(error: EngineError) -> bool:
    """A failure of the engine, not of the request: unreachable, connection lost, or 5xx."""
    return error.status is None or error.status >= 500


class EngineHealth:
    """The engines marked down (by URL); shared by the monitor thread and the generation."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._down: dict[str, str] = {}

    def mark_down(self, url: str, reason: str) -> None:
        with self._lock:
            if url not in self._down:
                logger.error("engine %s is down: %s", url, reason)
            self._down[url] = reason

    def is_down(self, url: str) -> bool:
        with self._lock:
            return url in self._down

    def down(self) -> dict[str, str]:
        with self._lock:
            return dict(self._down)

    def clear(self, url: str) -> None:
        with self._lock:
            self._down.pop(url, None)


class HealthMonitor:
    """A daemon thread polling every engine's /health_generate."""

    def __init__(self, urls: list[str], health: EngineHealth, interval_s: float, timeout_s: float):
        self.urls, self.health = urls, health
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slime-health-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import asyncio

        from slime.engines.client import ClientConfig, EngineClient

        async def check(url: str) -> None:
            config = ClientConfig(
                timeout_s=self.timeout_s, connect_timeout_s=min(self.timeout_s, 10.0), max_retries=0
            )
            async with EngineClient(url, config) as client:
                if not await client.health_generate(timeout_s=self.timeout_s):
                    self.health.mark_down(url, f"/health_generate failed for {self.timeout_s:g} s")

        while not self._stop.wait(self.interval_s):
            urls = [u for u in list(self.urls) if not self.health.is_down(u)]
            try:
                asyncio.run(asyncio.wait_for(asyncio.gather(*(check(u) for u in urls)), self.timeout_s + 5))
            except Exception as e:  # a check that itself failed: the next round tries again
                logger.warning("health check round failed: %s", e)

    def stop(self) -> None:
        self._stop.set()
