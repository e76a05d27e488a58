"""The RL loop: placement → engines → rollout manager → train ranks → (generate, train, push)*.

One loop for both schedules. `off_policy=False` (train.py): generate k, train k, push. With
`off_policy=True` (train_async.py) the generation of rollout k+1 is started before training k,
so its samples come from weights one version older; that staleness is checked, never more.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.config.arguments import Config, describe
from slime.ray.actors import EngineActor, TrainRank
from slime.ray.placement import Placement, Slot, plan_placement
from slime.ray.rollout_manager import RolloutManager

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0


def _in(pg: Any, slot: Slot, resource: str, **options: Any) -> dict[str, Any]:
    amount = {"num_gpus": slot.share, "num_cpus": 0} if resource == "GPU" else {"num_cpus": slot.share}
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=slot.bundles[0])
    return {**amount, "scheduling_strategy": strategy, **options}


class Job:
    """The processes of one run and the calls the loop makes on them."""

    def __init__(self, config: Config, log_dir: str):
        self.config = config
        c = config.cluster
        self.placement: Placement = plan_placement(c)
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
        self.engines: list[Any] = [
            ray.remote(EngineActor)
            .options(**_in(self.pg, slot, res))
            .remote(config.train.hf_checkpoint, engine_args, os.path.join(log_dir, f"engine{j}.log"))
            for j, slot in enumerate(self.placement.engines)
        ]
        self.engine_urls = ray.get([e.url.remote() for e in self.engines])
        self.manager: Any = ray.remote(RolloutManager).options(num_cpus=0).remote(config, self.engine_urls)
        first: Any = ray.remote(TrainRank).options(**_in(self.pg, self.placement.train[0], res))
        master_port = _free_port()
        world = c.num_train_ranks
        self.train: list[Any] = []
        for rank, slot in enumerate(self.placement.train):
            cls = first if rank == 0 else ray.remote(TrainRank).options(**_in(self.pg, slot, res))
            self.train.append(cls.remote(config.train, rank, world, "127.0.0.1", master_port, 1))
        self.infos = ray.get([t.init.remote() for t in self.train])
        ray.get([
            t.connect_engines.remote(config.bridge.transport, config.train.hf_checkpoint, c.device, self.engine_urls)
            for t in self.train
        ])  # fmt: skip

    def banner(self) -> str:
        lines = [f"{k}: {v}" for k, v in describe(self.config).items()] + self.placement.describe()
        lines.append(f"engines: {', '.join(self.engine_urls)}")
        return "\n  ".join(["slime job", *lines])

    def before_train(self, generation_running: bool) -> None:
        """Colocated: engines give their memory to the trainer while it trains (not while an
        off-policy generation still runs on them); with --offload the trainer takes its back."""
        c = self.config.cluster
        if c.colocate and not generation_running:
            ray.get(self.manager.engines.remote("release_memory_occupation"))
        if c.offload:
            ray.get([t.wake.remote() for t in self.train])

    def before_push(self) -> None:
        """Engines take their memory back first; the push then rewrites every parameter."""
        c = self.config.cluster
        if c.offload:
            ray.get([t.sleep.remote() for t in self.train])
        if c.colocate:
            ray.get(self.manager.engines.remote("resume_memory_occupation"))

    def push(self, version: int) -> dict[str, float]:
        stats = ray.get(
            [t.push_weights.remote(str(version), self.config.bridge.buffer_size) for t in self.train]
        )
        return stats[0] or {}

    def close(self) -> None:
        for calls in ([t.close.remote() for t in self.train], [e.stop.remote() for e in self.engines]):
            try:
                ray.get(calls, timeout=60)
            except Exception as e:  # shutting down after a failure must not hide it
                logger.warning("shutdown: %s", e)
        remove_placement_group(self.pg)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def num_rollouts(config: Config, num_prompts: int) -> int:
    if config.rollout.num_rollout is not None:
        return config.rollout.num_rollout
    assert config.rollout.num_epoch is not None
    return max(1, config.rollout.num_epoch * num_prompts // config.rollout.rollout_batch_size)


def check_staleness(batch_versions: list[str | None], current: int, off_policy: bool) -> None:
    allowed = 1 if off_policy else 0
    for v in batch_versions:
        if v is None or current - int(v) > allowed:
            raise RuntimeError(
                f"a sample was generated with weight_version {v} while the trainer is at {current}: "
                f"more than {allowed} version(s) stale"
            )


def run(config: Config, off_policy: bool, log_dir: str) -> int:
    """Run the whole job; returns the process exit code."""
    os.makedirs(log_dir, exist_ok=True)
    address = os.environ.get("RAY_ADDRESS")
    init: dict[str, Any] = {"log_to_driver": True, "include_dashboard": False}
    if not address and config.cluster.device == "cpu":
        # A local CPU cluster: each "GPU" is one process, not one core, so the logical CPU
        # count must cover every bundle even on a 2-core machine.
        needed = plan_placement(config.cluster).num_bundles
        init["num_cpus"] = max(os.cpu_count() or 1, needed)
    ray.init(address=address, **init)
    job = None
    try:
        job = Job(config, log_dir)
        logger.info(job.banner())
        total = num_rollouts(config, ray.get(job.manager.num_prompts.remote()))
        resumed = job.infos[0]["resumed_rollout_id"]
        start = 0 if resumed is None else resumed + 1
        version = start
        if resumed is not None:
            data_state = job.infos[0]["resumed_extra"].get("data")
            if data_state is not None:
                ray.get(job.manager.load_state_dict.remote(data_state))
            job.push(version)  # the engines start from --hf-checkpoint: give them the resumed weights
            logger.info("resumed after rollout %d (data position %s)", resumed, data_state)
        metrics_file = open(os.path.join(log_dir, "metrics.jsonl"), "a")  # noqa: SIM115 - closed below
        pending: Any = job.manager.generate.remote(start) if start < total else None
        saved, data_state = None, None
        for rollout_id in range(start, total):
            t0 = time.perf_counter()
            batch, rollout_metrics, samples, data_state = ray.get(pending)
            t_gen = time.perf_counter() - t0
            check_staleness([s["weight_version"] for s in samples], version, off_policy)
            pending = (
                job.manager.generate.remote(rollout_id + 1) if off_policy and rollout_id + 1 < total else None
            )
            t1 = time.perf_counter()
            job.before_train(generation_running=pending is not None)
            outputs = ray.get([t.train.remote(rollout_id, batch) for t in job.train])
            t_train = time.perf_counter() - t1
            if off_policy and pending is not None:
                ray.wait([pending])  # engines must be idle before the push
            t2 = time.perf_counter()
            version += 1
            job.before_push()
            push_stats = job.push(version)
            t_push = time.perf_counter() - t2
            if not off_policy and rollout_id + 1 < total:
                pending = job.manager.generate.remote(rollout_id + 1)
            record = {"rollout_id": rollout_id, **rollout_metrics, **outputs[0].rollout}
            for k, v in (outputs[0].steps[-1] if outputs[0].steps else {}).items():
                record[f"train/{k}"] = v
            record.update({"time/generate": t_gen, "time/train": t_train, "time/push": t_push,
                           "push/bytes": push_stats.get("bytes", 0.0)})  # fmt: skip
            if config.eval.interval and (rollout_id + 1) % config.eval.interval == 0:
                record.update(ray.get(job.manager.evaluate.remote(rollout_id)))
            if (
                config.checkpoint.save
                and config.checkpoint.save_interval
                and (rollout_id + 1) % config.checkpoint.save_interval == 0
            ):
                ray.get(
                    [
                        t.save.remote(rollout_id, config.checkpoint.save, {"data": data_state})
                        for t in job.train
                    ]
                )
                saved = rollout_id
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            logger.info("rollout %d/%d %s", rollout_id + 1, total, _short(record))
        metrics_file.close()
        if config.checkpoint.save and start < total and saved != total - 1:
            ray.get(
                [t.save.remote(total - 1, config.checkpoint.save, {"data": data_state}) for t in job.train]
            )
        if config.checkpoint.save_hf:
            ray.get([t.save_hf.remote(config.checkpoint.save_hf) for t in job.train])
        return 0
    finally:
        if job is not None:
            job.close()
        ray.shutdown()


def _short(record: dict[str, Any]) -> str:
    keys = (
        "rollout/reward_mean",
        "eval/accuracy",
        "train/loss",
        "train/grad_norm",
        "time/generate",
        "time/train",
    )
    return " ".join(f"{k.split('/')[-1]}={record[k]:.4g}" for k in keys if k in record)
