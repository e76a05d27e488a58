"""The inference engines as one EngineGroup (slime.loop.parts): their memory for colocation,
restarts of engines found down, the weight checks, and attaching external engines.

Control calls go from the driver straight to each engine's HTTP API (the rollout manager only
generates); what the health monitor found down is asked of the rollout manager.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Coroutine
from typing import Any

import ray

from slime.bridge.topology import PushTopology
from slime.engines.client import ClientConfig, EngineClient, EngineError
from slime.loop.parts import CACHE_TAGS, WEIGHT_TAGS
from slime.utils.aio import run_sync
from slime.utils.errors import UsageError

logger = logging.getLogger(__name__)


class ExternalEngineError(UsageError):
    """An engine named by --rollout-external-engine-addrs cannot be used (a usage error, exit 2)."""


class RayEngineGroup:
    """The engines at `urls`; `actors[j]` owns engine j's process (none for external engines) and
    `launch(j, log_name)` starts a fresh one on engine j's bundle."""

    def __init__(
        self,
        urls: list[str],
        actors: list[Any],
        launch: Callable[[int, str], Any],
        manager: Any,
        client_config: ClientConfig,
        colocate: bool,
        health_checks: bool,
        make_topology: Callable[[list[str]], PushTopology],
    ):
        self.urls, self.actors, self.launch, self.manager = list(urls), actors, launch, manager
        self.client_config, self.colocate, self.health_checks = client_config, colocate, health_checks
        self.make_topology = make_topology
        self.released: set[str] = set()  # memory tags colocated engines gave up for training
        self.restarts = 0

    @property
    def topology(self) -> PushTopology:
        """How a push reaches the engines at their current addresses."""
        return self.make_topology(self.urls)

    def _each(self, call: Callable[[int, EngineClient], Coroutine[Any, Any, Any]]) -> list[Any]:
        """`call(j, client)` on every engine at once; the answers in engine order."""

        async def run() -> list[Any]:
            clients = [EngineClient(u, self.client_config) for u in self.urls]
            try:
                return list(await asyncio.gather(*(call(j, c) for j, c in enumerate(clients))))
            finally:
                await asyncio.gather(*(c.close() for c in clients))

        return run_sync(run())

    def release_memory(self) -> None:
        if self.colocate and self.urls:
            self._each(lambda j, c: c.release_memory_occupation())  # every tag
            self.released = {*WEIGHT_TAGS, *CACHE_TAGS}

    def resume_memory(self, tags: tuple[str, ...]) -> None:
        if self.released.intersection(tags):
            self._each(lambda j, c: c.resume_memory_occupation(list(tags)))
            self.released.difference_update(tags)

    def snapshot_weights(self) -> None:
        self._each(lambda j, c: c.weights_checker("snapshot"))

    def scramble_weights(self) -> None:
        self._each(lambda j, c: c.weights_checker("reset_tensors"))

    def compare_weights(self) -> None:
        from slime.bridge.verify import WeightSyncError

        try:
            self._each(lambda j, c: c.weights_checker("compare"))
        except EngineError as e:
            raise WeightSyncError(
                "--check-weight-update-equal: after the first push an engine's weights differ from the checkpoint "
                f"it loaded ({e.url}):\n{e.message}\nEvery parameter was overwritten with noise before the "
                'push, so a parameter listed here was sent wrong or never sent. See docs/debugging.md "Parameter sync".'
            ) from None

    def dump_parameters(self, root: str) -> list[int]:
        """Engine j (tensor-parallel size 1 on the torch engine) dumps to root/<j>/."""
        answers = self._each(lambda j, c: c.dump_parameters(os.path.join(root, str(j))))
        return [a["num_parameters"] for a in answers]

    def restart_down(self) -> bool:
        """--rollout-health-check-interval: replace every engine found down by a fresh one on
        the same bundle; the caller's next push gives it the current weights."""
        if not self.health_checks or self.manager is None:
            return False
        down: dict[int, str] = ray.get(self.manager.down_engines.remote())
        if not down:
            return False
        if not self.actors:
            raise RuntimeError(
                f"external engine(s) {[self.urls[j] for j in down]} are down ({list(down.values())}); "
                "slime did not start them and cannot restart them"
            )
        for j, reason in down.items():
            old, old_url = self.actors[j], self.urls[j]
            try:
                ray.get(old.stop.remote(), timeout=30)
            except Exception as e:  # the actor may be gone with its engine
                logger.warning("stopping engine %d: %s", j, e)
            ray.kill(old, no_restart=True)
            self.restarts += 1
            self.actors[j] = self.launch(j, f"engine{j}-restart{self.restarts}.log")
            self.urls[j] = ray.get(self.actors[j].url.remote())
            ray.get(self.manager.replace_engine.remote(j, self.urls[j]))
            logger.warning("engine %d at %s was down (%s): restarted at %s; the next push gives it the current weights",
                           j, old_url, reason, self.urls[j])  # fmt: skip
        return True


def attach_external(urls: list[str], timeout_s: float) -> list[int]:
    """Check that every external engine answers /health and /get_server_info; log what it serves.
    Returns each engine's tensor-parallel size (as it reports it)."""

    async def probe(url: str) -> dict[str, Any]:
        async with EngineClient(url, ClientConfig(timeout_s=min(timeout_s, 30.0), max_retries=1)) as c:
            try:
                if not await c.health():
                    raise EngineError("GET /health did not answer 200", url=url)
                return await c.get_server_info()
            except EngineError as e:
                raise ExternalEngineError(
                    f"--rollout-external-engine-addrs: {url} cannot be used ({e.message}); start that engine "
                    "first or fix the address"
                ) from None

    async def probe_all() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(probe(u) for u in urls)))

    infos = run_sync(probe_all())
    for url, info in zip(urls, infos):
        logger.info("attached external engine %s: model_path %s, weight_version %s, tp_size %s",
                    url, info.get("model_path"), info.get("weight_version"), info.get("tp_size"))  # fmt: skip
    return [int(info.get("tp_size") or 1) for info in infos]
