"""The processes of one run: the placement group, then the engines, the rollout manager and the
train ranks, started together and shut down together. The loop reaches them through the typed
groups built here (RayTrainGroup, RayEngineGroup, a rollout source)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from slime.bridge.topology import DiskSettings, PushTopology, build_topology
from slime.config.arguments import Config, describe
from slime.config.lora import engine_launch_args
from slime.engines.client import ClientConfig
from slime.engines.protocol import API_KEY_ENV, PROFILE_DIR_ENV, new_api_key
from slime.ray.actors import (
    EngineActor,
    SGLangEngineActor,
    TrainRank,
    bundle_device,
    engines_leave_loopback,
    with_init_errors,
)
from slime.ray.engine_group import RayEngineGroup, attach_external
from slime.ray.placement import Placement, Slot, data_parallel_size, job_placement
from slime.ray.rollout_manager import RolloutManager
from slime.ray.train_group import RayTrainGroup
from slime.ray.waiting import RolloutBar, wait_refs
from slime.utils.job_trace import ENV

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0


def _in(pg: Any, slot: Slot, resource: str, **options: Any) -> dict[str, Any]:
    amount = {"num_gpus": slot.share, "num_cpus": 0} if resource == "GPU" else {"num_cpus": slot.share}
    strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=slot.bundles[0])
    return {**amount, "scheduling_strategy": strategy, **options}


def bundle_nodes(pg: Any) -> list[str]:
    """The address (as Ray knows it) of the node each bundle of a ready placement group is on."""
    from ray.util import placement_group_table

    address = {n["NodeID"]: str(n["NodeManagerAddress"]) for n in ray.nodes()}
    by_bundle = placement_group_table(pg)["bundles_to_node_id"]
    return [address[by_bundle[i]] for i in range(len(by_bundle))]


def engine_api_key(external: bool, off_loopback: bool) -> str | None:
    """The key of the engines a job starts (None: none; engines given by address get none from
    slime). SLIME_ENGINE_API_KEY in the driver's environment is used wherever the engines are,
    so that you know it (a Prometheus scrape of their /metrics); otherwise engines on a node
    address get a random key of the job's own (never logged), and on loopback none, where users'
    plugins keep posting to them as they always did."""
    if external:
        return None
    chosen = os.environ.get(API_KEY_ENV) or None
    return chosen or (new_api_key() if off_loopback else None)


class Job:
    """The processes of one run."""

    def __init__(self, config: Config, log_dir: str):
        self.config = config
        self.log_dir = log_dir
        self.train_group: Any = None  # RayTrainGroup, or slime.loop.critic.ActorCritic of two
        c = config.cluster
        self.with_trainer = not config.debug.rollout_only
        self.with_engines = not config.debug.train_only
        self.placement: Placement = job_placement(config)
        self.pg = placement_group(self.placement.bundle_specs(), strategy="PACK")
        ready, _ = ray.wait([self.pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"the Ray cluster cannot place {self.placement.num_bundles} bundles of "
                f"{self.placement.bundle_specs()[0]} within {PLACEMENT_TIMEOUT_S:.0f} s "
                f"(cluster resources: {ray.cluster_resources()}); lower the device counts or add nodes"
            )
        engine_args = ["--num-threads", "1", "--weight-version", "0", "--device", c.device]
        if config.train.deterministic:
            engine_args += ["--enable-deterministic-inference", "--random-seed", str(config.train.seed)]
        if config.train.moe.use_rollout_routing_replay:  # R3: engines report each token's experts
            engine_args.append("--enable-return-routed-experts")
        engine_args += engine_launch_args(config.train.lora, sglang=False)  # they serve the pushed adapter
        # The --sglang-* options the torch engine shares with SGLang (checked at parse).
        engine_args += c.sglang_server_args
        self.engine_args = engine_args
        # --trace-dir: every process records its events (slime.utils.job_trace).
        self.env_vars = {ENV: "1"} if config.debug.trace_dir is not None else {}
        self.api_key = engine_api_key(bool(c.external_engine_addrs), engines_leave_loopback())
        # SGLang's (and the torch engine's) profile directory: /start_profile writes under it only
        profile_dir = os.environ.get(PROFILE_DIR_ENV)
        self.engine_env = {PROFILE_DIR_ENV: os.path.abspath(profile_dir)} if profile_dir else {}
        self.dump_dir = (
            os.path.abspath(config.debug.sync_parameters_path) if config.debug.sync_parameters_path else None
        )
        self.engine_tp_sizes: list[int] = []
        if c.external_engine_addrs and self.with_engines:  # checked before anything starts
            self.engine_tp_sizes = attach_external(
                list(c.external_engine_addrs), config.train.distributed_timeout_minutes * 60
            )
        self.dp_size = data_parallel_size(config) if self.with_trainer else None
        self.manager: Any = None
        self.engines: list[Any] = []
        self.teacher: Any = None  # the OPD teacher engine (--opd-type sglang --opd-teacher-load)
        self.teacher_url: str | None = None
        self.train: list[Any] = []
        self.critic: list[Any] = []  # PPO's critic ranks (slime.backends.fsdp.critic)
        self.critic_infos: list[dict[str, Any]] = []
        self.rendezvous: tuple[str, int] | None = None
        self.infos: list[dict[str, Any]] = []
        self.engine_urls: list[str] = []
        self.engine_nodes: list[str] | None = None
        self._check_planned_push()
        self._start()
        dp = {int(info.get("dp", 1)) for info in self.infos}
        if self.infos and dp != {self.dp_size}:
            raise RuntimeError(
                f"the train ranks report {sorted(dp)} data-parallel replicas, the job planned {self.dp_size}"
            )

    def _start(self) -> None:
        """Start the engines, the rollout manager and the train ranks all at once (each spends
        seconds importing and loading: started one after the other, a job waited for the sum),
        wait for every one (the first failure ends the wait), then connect the manager to the
        engines. Engines that share GPUs with the train ranks (--colocate) start first."""
        c, res = self.config.cluster, self.placement.resource
        slots = [*self.placement.engines, *self.placement.teacher]
        self.engine_gpus = self._engine_gpus(slots) if c.rollout_backend == "sglang" else {}
        self.engines = [self._launch_engine(j, f"engine{j}.log") for j in range(len(self.placement.engines))]
        if self.placement.teacher:
            assert self.config.opd.teacher_load is not None
            self.teacher = self._start_engine(
                self.placement.teacher[0],
                len(self.placement.engines),
                self.config.opd.teacher_load,
                "teacher.log",
                dump=False,
            )
        # The rollout manager runs unless rollouts are replayed from dumps (train-only with a
        # rollout function keeps it, with no engines). Two threads: the progress bar reads the
        # sample count while a generation runs.
        if self.with_engines or self.config.debug.load_rollout_data is None:
            self.manager = (
                ray.remote(with_init_errors(RolloutManager))
                .options(num_cpus=0, max_concurrency=2, **self._env())
                .remote(self.config, self.log_dir, self.dp_size, self.api_key)
            )
        readies = [e.ready.remote() for e in self._engine_processes()]
        if c.colocate and res == "GPU":  # engines size their memory from what is free: before the trainer
            wait_refs(readies)
        world, d = c.num_train_ranks, self.config.debug
        env = self._env(c.train_env_vars)
        for rank, slot in enumerate(self.placement.train):
            cls = ray.remote(TrainRank).options(**_in(self.pg, slot, res, **env))
            self.train.append(
                cls.remote(self.config.train, rank, world, 1, d.hang_timeout, self.log_dir, d.phase_hook)
            )
        critic = self.config.critic
        for rank, slot in enumerate(self.placement.critic):
            assert critic is not None
            cls = ray.remote(TrainRank).options(**_in(self.pg, slot, res, **env))
            self.critic.append(
                cls.remote(
                    critic.train,
                    rank,
                    critic.num_ranks,
                    1,
                    d.hang_timeout,
                    self.log_dir,
                    d.phase_hook,
                    critic=True,
                )
            )
        # The train ranks rendezvous on rank 0's node (its address as Ray knows it), whichever
        # node that is; each rank gets the address by reference, without a round trip here. The
        # critic's ranks form a process group of their own.
        rendezvous = self.train[0].rendezvous_address.remote() if self.train else None
        inits = [t.init.remote(rendezvous) for t in self.train]
        critic_rendezvous = self.critic[0].rendezvous_address.remote() if self.critic else None
        critic_inits = [t.init.remote(critic_rendezvous) for t in self.critic]
        readies += [self.manager.ready.remote()] if self.manager is not None else []
        wait_refs([*readies, *inits, *critic_inits])
        self.infos = ray.get(inits)
        self.critic_infos = ray.get(critic_inits)
        self.rendezvous = ray.get(rendezvous) if rendezvous is not None else None
        if self.engines:
            self.engine_urls = ray.get([e.url.remote() for e in self.engines])
            self.engine_tp_sizes = [c.rollout_num_gpus_per_engine] * len(self.engine_urls)
            self.engine_nodes = ray.get([e.node_ip.remote() for e in self.engines])
        elif c.external_engine_addrs and self.with_engines:
            self.engine_urls = list(c.external_engine_addrs)
        if self.teacher is not None:
            self.teacher_url = ray.get(self.teacher.url.remote())
        if self.manager is not None:
            ray.get(self.manager.connect.remote(self.engine_urls, self.teacher_url))

    def topology(self, urls: list[str], indices: list[int]) -> PushTopology:
        """The weight push's topology (slime.bridge.topology) for engines `indices`, now at `urls`."""
        nodes = [self.engine_nodes[j] for j in indices] if self.engine_nodes is not None else None
        sizes = [self.engine_tp_sizes[j] for j in indices]
        return self._topology(urls, sizes, nodes, [i["node_ip"] for i in self.infos])

    def _topology(
        self, urls: list[str], tp_sizes: list[int], engine_nodes: list[str] | None, train_nodes: list[str]
    ) -> PushTopology:
        c, b = self.config, self.config.bridge
        return build_topology(
            c.bridge.transport,
            c.cluster.device,
            urls,
            tp_sizes,
            engine_nodes,
            train_nodes,
            sglang=c.cluster.rollout_backend == "sglang",
            colocated=c.cluster.colocate,
            pause_mode=c.rollout.asynchrony.pause_mode if c.rollout.asynchrony.fully_async else "in_place",
            disk=DiskSettings(
                b.mode, b.disk_dir, b.local_dir, b.delta_encoding, b.delta_checksum, b.disk_keep_files
            ),
        )

    def _check_planned_push(self) -> None:
        """Refuse a weight push that cannot reach an engine from where the placement group put the
        processes (a TopologyError, exit 2), before any of them starts: the nodes of its bundles
        are known once it is ready. The topology is built again from the running processes."""
        if not (self.with_trainer and self.with_engines):
            return
        c = self.config.cluster
        nodes = bundle_nodes(self.pg)
        train_nodes = [nodes[slot.bundles[0]] for slot in self.placement.train]
        if c.external_engine_addrs:
            self._topology(list(c.external_engine_addrs), self.engine_tp_sizes, None, train_nodes)
            return
        engines = self.placement.engines
        sizes = [c.rollout_num_gpus_per_engine] * len(engines)
        self._topology([""] * len(engines), sizes, [nodes[slot.bundles[0]] for slot in engines], train_nodes)

    def groups(
        self, progress: RolloutBar, phase: Any = None
    ) -> tuple[RayTrainGroup | None, RayEngineGroup | None]:
        """The train ranks and the engines as the loop drives them (None: left out by a debug mode);
        the train ranks are connected to the engines for the weight push. `phase`: the
        --debug-phase-hook (slime.debug.phases)."""
        c = self.config
        train: Any = RayTrainGroup(self.train, self.infos, c, self.log_dir, progress) if self.train else None
        if train is not None and self.critic:
            from slime.loop.critic import ActorCritic

            assert c.critic is not None
            critic_group = RayTrainGroup(
                self.critic, self.critic_infos, c, self.log_dir, progress, critic=True
            )
            critic_group.sleep()  # --offload: off the device until its first values (no-op otherwise)
            train = ActorCritic(train, critic_group, c.critic.num_critic_only_steps, c.critic.save)
        engines = None
        if self.engine_urls:
            engines = RayEngineGroup(
                self.engine_urls,
                self.engines,
                self._launch_engine,
                self.manager,
                ClientConfig(timeout_s=c.train.distributed_timeout_minutes * 60, api_key=self.api_key),
                c.cluster.offload_rollout,
                c.rollout.fault_tolerance,
                self.topology,
                phase,
                keep_weights=c.train.lora.pushes_adapter,
            )
        if train is not None and engines is not None:
            train.connect(engines)
        self.train_group = train
        return train, engines

    def _engine_gpus(self, slots: list[Slot]) -> dict[int, list[str] | None]:
        """--rollout-backend sglang: engine j (of `slots`) -> the GPU ids of its bundles (one
        node), learned by running a task in each bundle; None for every engine on a CPU cluster."""
        if self.placement.resource != "GPU":
            return {j: None for j in range(len(slots))}
        bundles = sorted({b for s in slots for b in s.bundles})
        probes = ray.get(
            [
                bundle_device.options(
                    num_gpus=0.01,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.pg, placement_group_bundle_index=b
                    ),
                ).remote()
                for b in bundles
            ]
        )
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
        return self._start_engine(self.placement.engines[j], j, self.config.train.hf_checkpoint, log_name)

    def _start_engine(self, slot: Slot, j: int, model_path: str, log_name: str, dump: bool = True) -> Any:
        """An engine on `model_path` in `slot` (`j`: its index in `_engine_gpus`); `dump`: it
        writes --debug-sync-parameters dumps (the rollout engines do, the teacher does not)."""
        options = _in(self.pg, slot, self.placement.resource, **self._env(self.engine_env))
        log_path = os.path.join(self.log_dir, log_name)
        c, t = self.config.cluster, self.config.train
        if c.rollout_backend == "sglang":
            launch = {
                "model_path": model_path,
                "tp_size": c.rollout_num_gpus_per_engine,
                "seed": t.seed,
                "deterministic": t.deterministic,
                "memory_saver": c.offload_rollout,
                "weight_version": "0",
                "extra_args": (
                    *c.sglang_server_args,
                    *engine_launch_args(t.lora, True, tuple(c.sglang_server_args)),
                ),
                "api_key": self.api_key,
            }
            timeout_s = self.config.train.distributed_timeout_minutes * 60
            return (
                ray.remote(with_init_errors(SGLangEngineActor))
                .options(**options)
                .remote(launch, self.engine_gpus[j], log_path, timeout_s)
            )
        return (
            ray.remote(with_init_errors(EngineActor))
            .options(**options)
            .remote(model_path, self.engine_args, log_path, self.api_key, self.dump_dir if dump else None)
        )

    def _env(self, env_vars: Mapping[str, str] | None = None) -> dict[str, Any]:
        """Ray options giving a process `env_vars` and the job's own (none: no options)."""
        merged = {**(env_vars or {}), **self.env_vars}
        return {"runtime_env": {"env_vars": merged}} if merged else {}

    def _engine_processes(self) -> list[Any]:
        """The engines slime started: the rollout's, and the OPD teacher's."""
        return [*self.engines, *([self.teacher] if self.teacher is not None else [])]

    def banner(self) -> str:
        d = self.config.debug
        mode = (
            "rollout only (no trainer)"
            if d.rollout_only
            else "train only (no engine)"
            if d.train_only
            else "full"
        )
        lines = [f"mode: {mode}", *getattr(self.config.args, "resolution", [])]
        lines += [f"{k}: {v}" for k, v in describe(self.config).items()] + self.placement.describe()
        lines.append(f"engines: {', '.join(self.engine_urls) or 'none'}")
        if self.teacher_url is not None:
            lines.append(f"OPD teacher engine: {self.teacher_url} ({self.config.opd.teacher_load})")
        if self.rendezvous is not None:
            nodes = ", ".join(info["node_ip"] for info in self.infos)
            lines.append(
                f"train ranks rendezvous at {self.rendezvous[0]}:{self.rendezvous[1]} (rank nodes: {nodes})"
            )
        if self.engine_nodes:
            lines.append(f"engine nodes: {', '.join(self.engine_nodes)}")
        lines.append(f"rollout manager: {'yes' if self.manager is not None else 'no (replaying dumps)'}")
        return "\n  ".join(["slime job", *lines])

    def close(self) -> None:
        if self.train_group is not None and self.train_group.hung:  # a hung rank never answers close()
            for t in [*self.train, *self.critic]:
                ray.kill(t, no_restart=True)
            self.train, self.critic = [], []
        # Every process is told at once (one after the other, a job's exit waited for the sum);
        # each failure is logged, and none stops the others from being waited for.
        calls = [t.close.remote() for t in [*self.train, *self.critic]]
        calls += [self.manager.close.remote()] if self.manager is not None else []
        calls += [e.stop.remote() for e in self._engine_processes()]
        if calls:
            ray.wait(calls, num_returns=len(calls), timeout=60)
        for call in calls:
            try:
                ray.get(call, timeout=0)
            except Exception as e:  # shutting down after a failure must not hide it
                logger.warning("shutdown: %s", e)
        remove_placement_group(self.pg)
