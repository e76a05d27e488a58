"""The processes of one run (placement group, engines, rollout manager, train ranks) and the
calls the loop makes on them: pushes, colocation, engine restarts, shutdown."""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.config.arguments import Config, describe
from slime.ray.actors import EngineActor, SGLangEngineActor, TrainRank, bundle_device
from slime.ray.checks import attach_external
from slime.ray.placement import Placement, Slot, plan_placement
from slime.ray.rollout_manager import RolloutManager

if TYPE_CHECKING:
    from slime.ray.loop import Progress

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0
# SGLang's memory tags (GPU_MEMORY_TYPE_*): colocated engines resume their weights before a push,
# the KV cache and CUDA graphs after it.
WEIGHT_TAGS = ("weights",)
CACHE_TAGS = ("kv_cache", "cuda_graph")


def _in(pg: Any, slot: Slot, resource: str, **options: Any) -> dict[str, Any]:
    amount = {"num_gpus": slot.share, "num_cpus": 0} if resource == "GPU" else {"num_cpus": slot.share}
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=slot.bundles[0])
    return {**amount, "scheduling_strategy": strategy, **options}


class Job:
    """The processes of one run and the calls the loop makes on them."""

    def __init__(self, config: Config, log_dir: str):
        self.config = config
        self.log_dir = log_dir
        self.hung = False
        self.restarts = 0
        self.engine_memory_released = False  # colocated engines between training and the next push
        c = config.cluster
        self.with_trainer = not config.debug.rollout_only
        self.with_engines = not config.debug.train_only
        self.placement: Placement = plan_placement(c, self.with_trainer, self.with_engines)
        self.pg = placement_group(self.placement.bundle_specs(), strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"the Ray cluster cannot place {self.placement.num_bundles} bundles of "
                f"{self.placement.bundle_specs()[0]} within {PLACEMENT_TIMEOUT_S:.0f} s "
                f"(cluster resources: {ray.cluster_resources()}); lower the device counts or add nodes"
            )
        res = self.placement.resource
        engine_args = ["--num-threads", "1", "--weight-version", "0", "--device", c.device]
        if config.train.deterministic:
            engine_args += ["--enable-deterministic-inference", "--random-seed", str(config.train.seed)]
        self.engine_args = engine_args
        self.engine_gpus = self._engine_gpus() if c.rollout_backend == "sglang" else {}
        self.engines: list[Any] = [
            self._launch_engine(j, f"engine{j}.log") for j in range(len(self.placement.engines))
        ]
        self.engine_urls: list[str] = ray.get([e.url.remote() for e in self.engines])
        if c.external_engine_addrs and self.with_engines:
            self.engine_urls = list(c.external_engine_addrs)
            attach_external(self.engine_urls, config.train.distributed_timeout_minutes * 60)
        # The rollout manager runs unless rollouts are replayed from dumps (train-only with a
        # rollout function keeps it, with no engines). Two threads: the progress bar reads the
        # sample count while a generation runs.
        self.manager: Any = None
        if self.with_engines or config.debug.load_rollout_data is None:
            self.manager = (
                ray.remote(RolloutManager)
                .options(num_cpus=0, max_concurrency=2)
                .remote(config, self.engine_urls, log_dir)
            )
        world = c.num_train_ranks
        self.train: list[Any] = []
        master_port = _free_port()
        for rank, slot in enumerate(self.placement.train):
            cls = ray.remote(TrainRank).options(**_in(self.pg, slot, res))
            self.train.append(
                cls.remote(
                    config.train, rank, world, "127.0.0.1", master_port, 1, config.debug.hang_timeout, log_dir
                )
            )
        self.infos = ray.get([t.init.remote() for t in self.train])
        if self.train and self.engine_urls:
            ray.get([
                t.connect_engines.remote(config.bridge.transport, config.train.hf_checkpoint, c.device,
                                         self.engine_urls, config.debug.push_fault, c.rollout_num_gpus_per_engine,
                                         c.rollout_backend == "sglang")
                for t in self.train
            ])  # fmt: skip

    def _engine_gpus(self) -> dict[int, list[str] | None]:
        """--rollout-backend sglang: engine j -> the GPU ids of its bundles (one node), learned by
        running a task in each bundle; None for every engine on a CPU cluster."""
        slots = self.placement.engines
        if self.placement.resource != "GPU":
            return {j: None for j in range(len(slots))}
        bundles = sorted({b for s in slots for b in s.bundles})
        probes = ray.get([
            bundle_device.options(num_gpus=0.01, scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.pg, placement_group_bundle_index=b)).remote()
            for b in bundles
        ])  # fmt: skip
        where = dict(zip(bundles, probes, strict=True))
        gpus: dict[int, list[str] | None] = {}
        for j, slot in enumerate(slots):
            nodes = {where[b][0] for b in slot.bundles}
            if len(nodes) > 1:
                raise RuntimeError(
                    f"engine {j} would span nodes {sorted(nodes)}: --rollout-num-gpus-per-engine "
                    f"{len(slot.bundles)} must fit in one node's GPUs"
                )
            gpus[j] = [where[b][1][0] for b in slot.bundles]
        return gpus

    def _launch_engine(self, j: int, log_name: str) -> Any:
        slot = self.placement.engines[j]
        options = _in(self.pg, slot, self.placement.resource)
        log_path = os.path.join(self.log_dir, log_name)
        c, t = self.config.cluster, self.config.train
        if c.rollout_backend == "sglang":
            launch = {
                "model_path": t.hf_checkpoint, "tp_size": c.rollout_num_gpus_per_engine, "seed": t.seed,
                "deterministic": t.deterministic, "memory_saver": c.colocate, "weight_version": "0",
                "extra_args": tuple(c.sglang_server_args),
            }  # fmt: skip
            timeout_s = self.config.train.distributed_timeout_minutes * 60
            return (
                ray.remote(SGLangEngineActor)
                .options(**options)
                .remote(launch, self.engine_gpus[j], log_path, timeout_s)
            )
        return ray.remote(EngineActor).options(**options).remote(t.hf_checkpoint, self.engine_args, log_path)

    def restart_down_engines(self) -> None:
        """--rollout-health-check-interval: replace every engine found down by a fresh one on
        the same bundle, before the push that gives it the current weights."""
        if self.manager is None or self.config.rollout.health_check_interval is None:
            return
        down: dict[int, str] = ray.get(self.manager.down_engines.remote())
        if not down:
            return
        if self.config.cluster.external_engine_addrs:
            raise RuntimeError(
                f"external engine(s) {[self.engine_urls[j] for j in down]} are down ({list(down.values())}); "
                "slime did not start them and cannot restart them"
            )
        for j, reason in down.items():
            old, old_url = self.engines[j], self.engine_urls[j]
            try:
                ray.get(old.stop.remote(), timeout=30)
            except Exception as e:  # the actor may be gone with its engine
                logger.warning("stopping engine %d: %s", j, e)
            ray.kill(old, no_restart=True)
            self.restarts += 1
            self.engines[j] = self._launch_engine(j, f"engine{j}-restart{self.restarts}.log")
            self.engine_urls[j] = ray.get(self.engines[j].url.remote())
            ray.get(self.manager.replace_engine.remote(j, self.engine_urls[j]))
            logger.warning("engine %d at %s was down (%s): restarted at %s; the next push gives it the current weights",
                           j, old_url, reason, self.engine_urls[j])  # fmt: skip
        c = self.config
        ray.get([
            t.connect_engines.remote(c.bridge.transport, c.train.hf_checkpoint, c.cluster.device, self.engine_urls,
                                     c.debug.push_fault, c.cluster.rollout_num_gpus_per_engine,
                                     c.cluster.rollout_backend == "sglang")
            for t in self.train
        ])  # fmt: skip

    def banner(self) -> str:
        d = self.config.debug
        mode = (
            "rollout only (no trainer)"
            if d.rollout_only
            else "train only (no engine)"
            if d.train_only
            else "full"
        )
        lines = [f"mode: {mode}"]
        lines += [f"{k}: {v}" for k, v in describe(self.config).items()] + self.placement.describe()
        lines.append(f"engines: {', '.join(self.engine_urls) or 'none'}")
        lines.append(f"rollout manager: {'yes' if self.manager is not None else 'no (replaying dumps)'}")
        return "\n  ".join(["slime job", *lines])

    def before_train(self, generation_running: bool) -> None:
        """Colocated: engines give their memory to the trainer while it trains (not while an
        off-policy generation still runs on them); with --offload the trainer takes its back."""
        c = self.config.cluster
        if c.colocate and self.engines and not generation_running:
            ray.get(self.manager.engines.remote("release_memory_occupation"))  # every tag
            self.engine_memory_released = True
        if c.offload:
            ray.get([t.wake.remote() for t in self.train])

    def before_push(self) -> None:
        """The trainer gives back its optimizer states (--offload; its parameters follow after the
        push, which all-gathers them on the device), then the engines take back the memory of
        their weights only, which the push rewrites; KV cache and CUDA graphs follow the push
        (`push`), so the push's buckets never sit beside a full KV cache."""
        c = self.config.cluster
        if c.offload:
            ray.get([t.sleep.remote(keep_params=True) for t in self.train])
        if self.engine_memory_released:
            ray.get(self.manager.engines.remote("resume_memory_occupation", list(WEIGHT_TAGS)))

    def push(self, version: int, progress: Progress | None = None) -> dict[str, float]:
        if not (self.train and self.engine_urls):
            return {}
        b = self.config.bridge
        refs = [t.push_weights.remote(str(version), b.buffer_size, b.verify) for t in self.train]
        stats = self.wait_train(refs, f"the weight push of version {version}", progress, "push")
        if self.config.cluster.offload:  # the parameters too, now that they are pushed
            ray.get([t.sleep.remote() for t in self.train])
        if self.engine_memory_released:  # colocated: the rest comes back once the weights are in
            ray.get(self.manager.engines.remote("resume_memory_occupation", list(CACHE_TAGS)))
            self.engine_memory_released = False
        return stats[0] or {}

    def wait_train(self, refs: list[Any], what: str, progress: Progress | None, phase: str) -> Any:
        """The train ranks' results; with --hang-timeout, HangError once `what` runs longer."""
        timeout = self.config.debug.hang_timeout
        try:
            return progress.wait(refs, phase, timeout) if progress is not None else wait_refs(refs, timeout)
        except TimeoutError:
            from slime.debug.hang import HangError, wait_for_dumps

            assert timeout is not None
            self.hung = True
            hang_dir = os.path.join(self.log_dir, "hang")
            found = wait_for_dumps(hang_dir, len(self.train))
            raise HangError(
                f"{what} has run longer than --hang-timeout {timeout:g} s: the Python stacks of "
                f"{len(found)} of {len(self.train)} train ranks are in {hang_dir}/ ({', '.join(found) or 'none written'})"
            ) from None

    def close(self) -> None:
        if self.hung:  # a hung rank never answers close(): end the train ranks outright
            for t in self.train:
                ray.kill(t, no_restart=True)
            self.train = []
        managers = [self.manager.close.remote()] if self.manager is not None else []
        for calls in (
            [t.close.remote() for t in self.train],
            managers,
            [e.stop.remote() for e in self.engines],
        ):
            try:
                ray.get(calls, timeout=60)
            except Exception as e:  # shutting down after a failure must not hide it
                logger.warning("shutdown: %s", e)
        remove_placement_group(self.pg)


def _free_port() -> int:

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_refs(refs: Any, timeout_s: float | None = None, poll: Any = None) -> Any:
    """ray.get(refs) (a plain value is returned as is), but a result that is an error is raised
    as soon as it arrives, not after the others (a rank that failed may leave its peers waiting
    for it forever); TimeoutError after `timeout_s`. `poll()` runs every half second."""
    if not isinstance(refs, list | ray.ObjectRef):
        return refs
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pending = refs if isinstance(refs, list) else [refs]
    while True:
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
        ray.get(ready)  # raises the first failure among those done
        if not pending:
            return ray.get(refs)
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError
        if poll is not None:
            poll()
