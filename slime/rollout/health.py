"""Engine health for the rollout (--use-fault-tolerance): which engines are down, found by the
monitor, by a failed request or by a failed control call, so that a group's samples are generated
again on a live engine (never lost, never twice) and the driver restarts the engine.

`EngineHealth` holds the engines' slots (engine index -> its current address) and the ones down;
the monitor thread, the generation (an event loop in another thread) and the driver's calls to the
rollout manager all read and change it under one lock. `HealthMonitor` asks every live engine for
`/health_generate` (a real one-token generation) every `--rollout-health-check-interval` seconds;
one that does not answer 200 within `--rollout-health-check-timeout` seconds is marked down. It
waits `--rollout-health-check-first-wait` seconds before its first round and after every resume,
and pauses while colocated engines have given their memory to the trainer (they cannot generate).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from slime.engines.client import ClientConfig, EngineClient, EngineError
from slime.utils.job_trace import instant, span

logger = logging.getLogger(__name__)


def engine_down(error: EngineError) -> bool:
    """A failure of the engine, not of the request: unreachable, connection lost, or 5xx."""
    return error.status is None or error.status >= 500


class EngineHealth:
    """The engines by slot, and the ones marked down (by address, with the reason)."""

    def __init__(self, urls: list[str]) -> None:
        self._lock = threading.Lock()
        self._urls = list(urls)
        self._down: dict[str, str] = {}

    def mark_down(self, url: str, reason: str) -> bool:
        """True when `url` was up until now."""
        with self._lock:
            if url in self._down or url not in self._urls:
                return False
            self._down[url] = reason
        logger.error("engine %s is down: %s", url, reason)
        return True

    def is_down(self, url: str) -> bool:
        with self._lock:
            return url in self._down or url not in self._urls

    def down(self) -> dict[int, str]:
        """Engine index -> why it is down."""
        with self._lock:
            return {j: self._down[u] for j, u in enumerate(self._urls) if u in self._down}

    def live(self) -> list[str]:
        """The addresses of the engines up now, in slot order."""
        with self._lock:
            return [u for u in self._urls if u not in self._down]

    def urls(self) -> list[str]:
        with self._lock:
            return list(self._urls)

    def replace(self, index: int, url: str) -> str:
        """Slot `index` is now the (restarted, up-to-date) engine at `url`; returns the old address."""
        with self._lock:
            old = self._urls[index]
            self._urls[index] = url
            self._down.pop(old, None)
            return old


class HealthMonitor:
    """A daemon thread checking every live engine's /health_generate, round after round.

    `also` runs after every round (the rollout manager checks the router it started there)."""

    def __init__(
        self,
        health: EngineHealth,
        interval_s: float,
        timeout_s: float,
        first_wait_s: float = 0.0,
        also: Callable[[], None] | None = None,
    ):
        self.health = health
        self.interval_s, self.timeout_s, self.first_wait_s = interval_s, timeout_s, first_wait_s
        self.also = also
        self.rounds = 0
        self._stop = threading.Event()
        self._running = threading.Event()  # cleared while paused
        self._running.set()
        self._resumed = threading.Event()  # a resume asks for the first wait again
        self._in_round = threading.Lock()  # held while a round runs: pause() waits for it
        self._thread = threading.Thread(target=self._run, name="slime-health-monitor", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        wait = self.first_wait_s
        while not self._stop.is_set():
            if not self._running.is_set():
                self._stop.wait(0.1)
                continue
            if self._resumed.is_set():
                self._resumed.clear()
                wait = self.first_wait_s
            if wait and self._stop.wait(wait):
                return
            wait = 0.0
            if self._resumed.is_set() or not self._running.is_set():
                continue  # paused or resumed during the wait: wait again from the resume
            with self._in_round:
                if not self._running.is_set():
                    continue
                try:
                    live = len(self.health.live())
                    with span("health check", "checks", track="health checks", engines=live):
                        asyncio.run(self.check_round())
                    if self.also is not None:
                        self.also()
                except Exception as e:  # a round that failed as a whole: the next one tries again
                    logger.warning("health check round failed: %s", e)
            self.rounds += 1
            self._stop.wait(self.interval_s)

    async def check_round(self) -> list[str]:
        """Check every live engine once, concurrently; returns the ones marked down."""
        config = ClientConfig(
            timeout_s=self.timeout_s, connect_timeout_s=min(self.timeout_s, 10.0), max_retries=0
        )
        urls = self.health.live()

        async def check(url: str) -> bool:
            async with EngineClient(url, config) as client:
                return await client.health_generate(timeout_s=self.timeout_s)

        answers = await asyncio.gather(*(check(u) for u in urls))
        down = [u for u, ok in zip(urls, answers, strict=True) if not ok]
        for url in down:
            self.health.mark_down(url, f"/health_generate did not answer 200 within {self.timeout_s:g} s")
            instant("engine down", "checks", cat="fault", track="health checks", url=url)
        return down

    def pause(self) -> None:
        """Colocated engines give their memory up: they cannot answer /health_generate. Returns
        once no round runs."""
        self._running.clear()
        with self._in_round:
            pass

    def resume(self) -> None:
        self._resumed.set()
        self._running.set()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeout_s + 5)
