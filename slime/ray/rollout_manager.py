"""The RolloutManager actor: a Ray actor around slime.rollout.producer.RolloutProducer.

It adds what only the job has: the router in front of the engines (slime.engines.router_front),
the key the engines require (handed on to slime.utils.http_utils for plugins), the address
slime's plugins post to (`args.sglang_router_ip/port`), the health monitor of
--use-fault-tolerance, and Ray's object store for the train parts. Everything that produces a
rollout is the producer's.

No method here is a coroutine: Ray runs a class with one as an async actor, whose methods share
one event loop, so a running generate() would block the driver's health calls.
"""

from __future__ import annotations

import os
from typing import Any

from slime.config.arguments import Config
from slime.engines.router_front import RouterFront
from slime.ray.actors import Traced
from slime.rollout.health import HealthMonitor
from slime.rollout.producer import RolloutProducer
from slime.utils.job_trace import span
from slime.utils.net import host_port
from slime.utils.rollout_batch import Evaluation, Rollout


def _put(part: Any) -> Any:
    import ray

    return ray.put(part)


class RolloutManager(Traced):
    """Produces rollouts and evaluations for the job (a Ray actor). Built without the engines,
    then `connect(engine_urls)` once they answer.

    `dp_size`: the data-parallel replicas each rollout is split for (None: nothing trains);
    `api_key`: the key the engines (and a router slime starts) require."""

    def __init__(
        self, config: Config, log_dir: str = ".", dp_size: int | None = None, api_key: str | None = None
    ):
        from slime.ray.actors import engine_host
        from slime.utils.logging_utils import configure_logging

        configure_logging("rollout")
        self.config, self.api_key = config, api_key
        self.producer = RolloutProducer(config, dp_size, _put, api_key)
        c = config.cluster
        given = None
        if c.router_ip is not None:
            assert c.router_port is not None
            given = (c.router_ip, c.router_port)
        self.front = RouterFront(
            c.rollout_backend, given, engine_host, os.path.join(log_dir, "router.log"), api_key
        )
        self.monitor: HealthMonitor | None = None

    def connect(self, engine_urls: list[str], teacher_url: str | None = None) -> None:
        """Generate with the engines at `engine_urls` (once, before the first rollout), behind
        the router; score with the OPD teacher at `teacher_url` or --opd-teacher-url."""
        p, r = self.producer, self.config.rollout
        p.connect(engine_urls, teacher_url)
        self.front.start(p.engine_urls)
        self._publish()
        # --use-fault-tolerance: engines found down (by the monitor, a failed request or a failed
        # control call of the driver's) have their groups generated elsewhere; the driver restarts
        # them and gives them the weights before they are replaced here.
        if p.health is not None:
            self.monitor = HealthMonitor(
                p.health,
                r.health_check_interval,
                r.health_check_timeout,
                r.health_check_first_wait,
                also=self._check_router,
            )

    def _publish(self) -> None:
        """Where plugins post: slime's custom functions post to
        http://{args.sglang_router_ip}:{args.sglang_router_port}, the router in front of every
        engine, or (torch engines without a router) engine 0; slime.utils.http_utils.post/get
        carry the engines' key to the router and the engines (to those addresses only)."""
        from slime.utils.http_utils import register_credentials

        p, args, router = self.producer, self.config.args, self.front.router
        p.router_url = self.front.url
        if router is not None:
            args.sglang_router_ip, args.sglang_router_port = router.host, router.port
        elif p.engine_urls:
            args.sglang_router_ip, args.sglang_router_port = host_port(p.engine_urls[0])
        register_credentials(list(p.engine_urls) + ([router.url] if router is not None else []), self.api_key)

    def _check_router(self) -> None:
        """The health monitor's thread: a router slime started that died is started again."""
        health = self.producer.health
        assert health is not None
        with self.front.lock:  # the address published is the router's that is running
            if self.front.restart_if_dead(health.live):
                self._publish()

    def close(self) -> None:
        """Stop the continuous pool, the health monitor and the router slime started (a router
        given by --sglang-router-ip keeps running, without the engines slime registered there)."""
        self.producer.close()
        if self.monitor is not None:
            self.monitor.stop()
        self.front.close()

    # ---- what the driver asks -----------------------------------------------------------------
    def num_prompts(self) -> int:
        return self.producer.num_prompts()

    def generate(self, rollout_id: int, weight_version: int = 0) -> Rollout:
        """Rollout `rollout_id` for the trainer at `weight_version`; its parts go to the object
        store, its dump to --save-debug-rollout-data; the summary comes back."""
        with span("generate", "rollout", rollout_id=rollout_id):
            return self.producer.generate(rollout_id, weight_version)

    def take(self, rollout_id: int, weight_version: int) -> Rollout:
        """--fully-async: rollout `rollout_id` from the continuous pool."""
        with span("take", "rollout", rollout_id=rollout_id):
            return self.producer.take(rollout_id, weight_version)

    def evaluate(self, rollout_id: int) -> Evaluation:
        with span("evaluate", "eval", rollout_id=rollout_id):
            return self.producer.evaluate(rollout_id)

    def progress_counts(self) -> tuple[int, int]:
        """(samples finished, samples wanted) of the generation running now (a concurrent call)."""
        progress = self.producer.progress
        return progress.done, progress.total

    def down_engines(self) -> dict[int, str]:
        """Engine index -> why it is down (empty without --use-fault-tolerance)."""
        health = self.producer.health
        return health.down() if health is not None else {}

    def mark_down(self, index: int, reason: str) -> None:
        """The driver found engine `index` down (a failed control call or push): no request goes
        there, and its groups in flight are generated again elsewhere."""
        health = self.producer.health
        if health is not None:
            health.mark_down(health.urls()[index], reason)

    def replace_engine(self, index: int, url: str) -> None:
        """A restarted engine, given the current weights, takes the place (and the turn) of the
        one that went down."""
        old = self.producer.engine_urls[index]
        self.producer.replace_engine(index, url)
        with self.front.lock:
            self.front.swap(old, url)
            self._publish()

    def pause_health(self) -> None:
        """Colocated engines give their memory up (no /health_generate until they resume)."""
        if self.monitor is not None:
            self.monitor.pause()

    def resume_health(self) -> None:
        if self.monitor is not None:
            self.monitor.resume()

    def state_dict(self) -> dict[str, Any]:
        return self.producer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.producer.load_state_dict(state)
