"""The inference engines as one EngineGroup (slime.loop.parts): their memory for colocation,
their health and restarts (--use-fault-tolerance), the weight checks, and attaching external engines.

Control calls go from the driver straight to each engine's HTTP API (the rollout manager only
generates); what the health monitor and the requests found down is asked of the rollout manager.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Coroutine
from typing import Any

import ray

from slime.bridge.topology import PushTopology
from slime.debug.phases import no_hook
from slime.engines.client import ClientConfig, EngineClient, EngineError
from slime.loop.parts import CACHE_TAGS, WEIGHT_TAGS
from slime.rollout.health import engine_down
from slime.utils.async_utils import run_sync
from slime.utils.errors import UsageError
from slime.utils.job_trace import RECORDER, instant

logger = logging.getLogger(__name__)


class ExternalEngineError(UsageError):
    """An engine named by --rollout-external-engine-addrs cannot be used (a usage error, exit 2)."""


class RayEngineGroup:
    """The engines at `urls`; `actors[j]` owns engine j's process (none for external engines) and
    `launch(j, log_name)` starts a fresh one on engine j's bundle.

    With --use-fault-tolerance the group owns the engines' health: an engine found down (by the
    rollout manager's monitor or requests, or by a control call or push here) is marked down with
    the manager, which stops sending it requests; `heal()` restarts it on its bundle in the
    background; once the new process answers it is *joining* and takes requests only after the loop
    gave it the current weights and `admit()`ed it. Control calls and pushes reach the engines
    that are up (and joining, for a push)."""

    def __init__(
        self,
        urls: list[str],
        actors: list[Any],
        launch: Callable[[int, str], Any],
        manager: Any,
        client_config: ClientConfig,
        release_for_training: bool,
        fault_tolerance: bool,
        make_topology: Callable[[list[str], list[int]], PushTopology],
        phase: Callable[..., None] | None = None,
        keep_weights: bool = False,
    ):
        self.urls, self.actors, self.launch, self.manager = list(urls), actors, launch, manager
        self.client_config, self.fault_tolerance = client_config, fault_tolerance
        self.release_for_training = release_for_training  # colocated, unless --no-offload-rollout
        # --lora-push adapter: the pushes never send the base weights, so the engines keep them
        # (only their caches are released for training).
        self.keep_weights = keep_weights
        self.make_topology = make_topology
        self.phase = phase or no_hook
        self.released: set[str] = set()  # memory tags colocated engines gave up for training
        self.restarts = 0
        self.restarting: dict[int, tuple[Any, Any, float]] = {}  # j -> (actor, url ref, started)
        self.joining: dict[int, str] = {}  # j -> address: restarted, not yet given the weights
        self.failed_starts: dict[int, int] = {}  # j -> restarts that died before admission
        self.changes = 0
        """Counts engines marked down, restarted and admitted (a push bridge older than that is stale)."""

    # ---- which engines ---------------------------------------------------------------------------
    def up(self) -> list[int]:
        return [j for j in range(len(self.urls)) if j not in self.restarting and j not in self.joining]

    def up_urls(self) -> list[str]:
        return [self.urls[j] for j in self.up()]

    def targets(self) -> list[int]:
        """The engines a push reaches: those up and those joining."""
        return sorted([*self.up(), *self.joining])

    @property
    def topology(self) -> PushTopology:
        """How a push reaches the engines that are up or joining, at their current addresses."""
        return self.topology_of(self.targets())

    def topology_of(self, indices: list[int]) -> PushTopology:
        return self.make_topology([self.url(j) for j in indices], indices)

    def url(self, j: int) -> str:
        """Engine j's address: the restarted process's once it answers."""
        return self.joining.get(j, self.urls[j])

    # ---- health ------------------------------------------------------------------------------------
    def mark_down(self, j: int, reason: str) -> None:
        """--use-fault-tolerance: engine j failed a call of the driver's or a push; the manager
        stops using it and it is restarted in the background."""
        logger.error("engine %d at %s is down: %s", j, self.urls[j], reason)
        self.changes += 1
        if self.manager is not None:
            ray.get(self.manager.mark_down.remote(j, reason))
        self._restart(j, reason)

    def probe(self) -> dict[int, str]:
        """After a failed push or control call: every engine up that does not answer /health is
        marked down. Returns them (empty: the failure was not an engine's)."""
        if not self.fault_tolerance:
            return {}
        targets = self.targets()
        config = ClientConfig(timeout_s=10.0, connect_timeout_s=5.0, max_retries=1)

        async def check(url: str) -> bool:
            async with EngineClient(url, config) as c:
                return await c.health()

        async def check_all() -> list[bool]:
            return list(await asyncio.gather(*(check(self.url(j)) for j in targets)))

        down = {j: "does not answer /health" for j, ok in zip(targets, run_sync(check_all())) if not ok}
        for j, reason in down.items():
            if j in self.joining:  # died before it was admitted: start it again (a few times)
                del self.joining[j]
                self._count_failed_start(j, reason)
                self._restart(j, reason)
            else:
                self.mark_down(j, reason)
        return down

    def _restart(self, j: int, reason: str) -> None:
        """Replace engine j by a fresh process on its bundle, in the background."""
        if j in self.restarting:
            return
        if not self.actors:
            raise RuntimeError(
                f"external engine {self.urls[j]} is down ({reason}); slime did not start it and cannot "
                "restart it"
            )
        old = self.actors[j]
        try:
            ray.get(old.stop.remote(), timeout=30)
        except Exception as e:  # the actor may be gone with its engine
            logger.warning("stopping engine %d: %s", j, e)
        ray.kill(old, no_restart=True)
        self.restarts += 1
        self.changes += 1
        instant("restart", "faults", cat="fault", track=f"engine {j}", reason=reason)
        actor = self.launch(j, f"engine{j}-restart{self.restarts}.log")
        self.actors[j] = actor
        self.restarting[j] = (actor, actor.url.remote(), time.monotonic())
        logger.warning("engine %d at %s is down (%s): restarting it on its bundle", j, self.urls[j], reason)

    def _count_failed_start(self, j: int, reason: str) -> None:
        self.failed_starts[j] = self.failed_starts.get(j, 0) + 1
        if self.failed_starts[j] >= 3:
            raise RuntimeError(
                f"engine {j} failed 3 restarts in a row (it died before it took requests); the last: {reason}"
            )

    def heal(self, wait: bool = False) -> list[int]:
        """--use-fault-tolerance: restart every engine the manager found down; returns the engines
        restarted and ready for the weights (joining). With `wait`, first wait (up to the client
        timeout) until some engine is up or joining."""
        if not self.fault_tolerance or self.manager is None:
            return []
        for j, reason in ray.get(self.manager.down_engines.remote()).items():
            if j not in self.restarting and j not in self.joining:
                self._restart(j, reason)
        deadline = time.monotonic() + self.client_config.timeout_s
        while True:
            for j, (_, ref, started) in list(self.restarting.items()):
                if not ray.wait([ref], timeout=0)[0]:
                    continue
                del self.restarting[j]
                try:
                    url = ray.get(ref)
                except Exception as e:
                    self._count_failed_start(j, str(e))
                    logger.error("engine %d did not start (%s); trying again", j, e)
                    self._restart(j, f"its restart failed: {e}")
                    continue
                self.joining[j] = url
                now = RECORDER.now_ns()  # the restart, on the engine's track
                began = now - int((time.monotonic() - started) * 1e9)
                RECORDER.complete("restarting", began, now, "faults", "fault", track=f"engine {j}", url=url)
                logger.warning(
                    "engine %d restarted at %s in %.1f s; it takes requests once it has the weights",
                    j,
                    url,
                    time.monotonic() - started,
                )
            if not wait or self.joining or self.up():
                return sorted(self.joining)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"every engine is down and none restarted within {self.client_config.timeout_s:.0f} s"
                )
            time.sleep(0.2)

    def admit(self, indices: list[int]) -> None:
        """Joining engines given the current weights: they take requests from now on."""
        for j in indices:
            url = self.joining.pop(j)
            self.urls[j] = url
            self.changes += 1
            self.failed_starts.pop(j, None)
            if self.manager is not None:
                ray.get(self.manager.replace_engine.remote(j, url))
            logger.warning("engine %d at %s has the current weights and takes requests again", j, url)
            self.phase("admitted", engine=url, index=j)

    # ---- control calls -------------------------------------------------------------------------------
    def _each(
        self, call: Callable[[int, EngineClient], Coroutine[Any, Any, Any]], strict: bool = False
    ) -> list[Any]:
        """`call(j, client)` on every engine up, at once; the answers in engine order. With
        --use-fault-tolerance an engine that fails as an engine (unreachable, 5xx) is marked down
        and left out of the answers, unless `strict` (the weight checks: every engine must answer)."""
        indices = self.up()

        async def run() -> list[Any]:
            clients = [EngineClient(self.urls[j], self.client_config) for j in indices]
            try:
                return list(
                    await asyncio.gather(
                        *(call(j, c) for j, c in zip(indices, clients)), return_exceptions=True
                    )
                )
            finally:
                await asyncio.gather(*(c.close() for c in clients))

        answers = []
        for j, answer in zip(indices, run_sync(run())):
            if (
                isinstance(answer, EngineError)
                and self.fault_tolerance
                and engine_down(answer)
                and not strict
            ):
                self.mark_down(j, answer.message)
            elif isinstance(answer, BaseException):
                raise answer
            else:
                answers.append(answer)
        return answers

    def pause_checks(self) -> None:
        if self.fault_tolerance and self.manager is not None:
            ray.get(self.manager.pause_health.remote())

    def resume_checks(self) -> None:
        if self.fault_tolerance and self.manager is not None and not self.released:
            ray.get(self.manager.resume_health.remote())

    def release_memory(self) -> None:
        if self.release_for_training and self.urls:
            self.pause_checks()  # released engines cannot answer /health_generate
            self.phase("release", engines=self.up_urls())
            if self.keep_weights:
                self._each(lambda j, c: c.release_memory_occupation(list(CACHE_TAGS)))
                self.released = set(CACHE_TAGS)
            else:
                self._each(lambda j, c: c.release_memory_occupation())  # every tag
                self.released = {*WEIGHT_TAGS, *CACHE_TAGS}

    def resume_memory(self, tags: tuple[str, ...]) -> None:
        if self.released.intersection(tags):
            self.phase("resume", engines=self.up_urls(), tags=list(tags))
            self._each(lambda j, c: c.resume_memory_occupation(list(tags)))
            self.released.difference_update(tags)
            if not self.released:
                self.resume_checks()

    def snapshot_weights(self) -> None:
        self._each(lambda j, c: c.weights_checker("snapshot"), strict=True)

    def scramble_weights(self) -> None:
        self._each(lambda j, c: c.weights_checker("reset_tensors"), strict=True)

    def compare_weights(self) -> list[str]:
        """Every engine's /weights_checker "compare"; the notes of those that gave one (the torch
        engine: parameters compared rounded to the dtype they arrived in)."""
        from slime.bridge.verify import WeightSyncError

        try:
            answers = self._each(lambda j, c: c.weights_checker("compare"), strict=True)
        except EngineError as e:
            raise WeightSyncError(
                "--check-weight-update-equal: after the first push an engine's weights differ from the "
                f"checkpoint it loaded ({e.url}):\n{e.message}\nEvery parameter was overwritten with noise "
                "before the push, so a parameter listed here was sent wrong or never sent. See "
                'docs/debugging.md "Parameter sync".'
            ) from None
        return [a["note"] for a in answers if isinstance(a, dict) and a.get("note")]

    def dump_parameters(self, root: str) -> list[int]:
        """Engine j (tensor-parallel size 1 on the torch engine) dumps to root/<j>/."""
        answers = self._each(lambda j, c: c.dump_parameters(os.path.join(root, str(j))), strict=True)
        return [a["num_parameters"] for a in answers]


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
        logger.info(
            "attached external engine %s: model_path %s, weight_version %s, tp_size %s",
            url,
            info.get("model_path"),
            info.get("weight_version"),
            info.get("tp_size"),
        )
    return [int(info.get("tp_size") or 1) for info in infos]
