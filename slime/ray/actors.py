"""Ray actors: one train rank, one rollout engine. Thin shells around Ray-free classes.

Each actor is created inside its placement-group bundle with the share planned by
slime.ray.placement. Their methods are the TrainActor protocol's, so the loop drives a group of
them exactly as tests drive FSDPTrainActor directly.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import ray

from slime.config.train import TrainConfig
from slime.utils.async_utils import run_sync
from slime.utils.job_trace import RECORDER, span
from slime.utils.rollout_batch import RolloutBatch, TrainOutput

if TYPE_CHECKING:
    from slime.bridge.topology import PushTopology

logger = logging.getLogger(__name__)


def with_init_errors(cls: type) -> type:
    """`cls` as a Ray actor class whose constructor keeps a UsageError for `ready()` to raise.

    Ray reports an error raised in an actor's constructor as ActorDiedError, carrying the
    original exception only as text; raised from a method it stays an exception of its own type
    (RayTaskError subclasses it), which the driver turns into one line and exit code 2."""
    from slime.utils.errors import UsageError

    class Actor(cls):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any):
            self._init_error: UsageError | None = None
            try:
                super().__init__(*args, **kwargs)
            except UsageError as e:
                self._init_error = e

        def ready(self) -> None:
            if self._init_error is not None:
                raise self._init_error

    Actor.__name__ = Actor.__qualname__ = cls.__name__
    return Actor


def node_ip() -> str:
    """The address of this process's node as the Ray cluster knows it (its raylet's address).

    Not ray.util.get_node_ip_address(), which guesses from this machine's interfaces: where
    several nodes share one machine (loopback test clusters) the guess names another node."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return str(node["NodeManagerAddress"])
    raise RuntimeError(f"Ray lists no node {node_id} for this process")


def _quiet_threads(num_threads: int) -> None:
    import torch

    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    torch.set_num_threads(num_threads)


class Traced:
    """What the driver asks every process it started for the job's timeline (--trace-dir;
    slime.ray.tracing): its node, its clock, and its events since the last time."""

    def trace_node(self) -> str:
        return node_ip()

    def trace_clock(self) -> int:
        return RECORDER.now_ns()

    def trace_events(self) -> list[dict[str, Any]]:
        return RECORDER.drain()


class TrainRank(Traced):
    """One data-parallel rank of the trainer (a Ray actor)."""

    def __init__(
        self,
        cfg: TrainConfig,
        rank: int,
        world_size: int,
        threads: int,
        hang_timeout_s: float | None = None,
        log_dir: str = ".",
        phase_hook: str | None = None,
        critic: bool = False,
    ):
        """`phase_hook`: --debug-phase-hook (slime.debug.phases); `critic`: PPO's value model."""
        from slime.debug.phases import load_phase_hook
        from slime.utils.logging_utils import configure_logging

        _quiet_threads(threads)
        configure_logging(f"rank {rank}")
        from slime.backends import make_train_actor

        self.rank, self.critic = rank, critic
        self.phase = load_phase_hook(phase_hook)
        # A TrainActor, or with `critic` a CriticActor (slime.backends.interface): one Ray actor class
        # serves both roles, and the driver calls each role's methods only.
        self.actor: Any = make_train_actor(cfg, rank, world_size, critic=critic)
        self.bridge: Any = None
        self.fault: Any = None  # --debug-push-fault
        self.topology: Any = None  # slime.bridge.topology.PushTopology, from connect_engines
        self.watchdog: Any = None
        if hang_timeout_s is not None:
            from slime.debug.hang import HangWatchdog

            name = f"{'critic' if critic else 'train'} rank {rank}"
            path = os.path.join(log_dir, "hang", f"{'critic' if critic else ''}rank{rank}.txt")
            self.watchdog = HangWatchdog(hang_timeout_s, path, header=f"{name} of {world_size}, ")

    def _watch(self, what: str) -> Any:
        import contextlib

        return self.watchdog.watch(what) if self.watchdog is not None else contextlib.nullcontext()

    def rendezvous_address(self) -> tuple[str, int]:
        """(this node's IP address as Ray knows it, a free port on it): where rank 0 hosts the
        train process group's rendezvous, reachable from every node."""
        from slime.utils.net import free_port

        host = node_ip()
        return host, free_port(host)

    def init(self, rendezvous: tuple[str, int]) -> dict[str, Any]:
        """Join the train process group at `rendezvous` (address, port), then build the model."""
        master_addr, master_port = rendezvous
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        info = {**self.actor.init(), "node_ip": node_ip()}
        if self._keeps_old_actor():  # the engines' weights until the first push (the job starts them at "0")
            self.actor.keep_weights("0")
        return info

    def _keeps_old_actor(self) -> bool:
        """--keep-old-actor on a policy rank (a critic's weights never generate)."""
        loss = getattr(getattr(self.actor, "cfg", None), "loss", None)
        return not self.critic and bool(getattr(loss, "keep_old_actor", False))

    def train(
        self, rollout_id: int, batch: RolloutBatch, values: list[Any] | None = None, update: bool = True
    ) -> TrainOutput:
        """One rollout's steps. PPO: `values` are the critic ranks' `values` answers (object
        references, fetched here, never in the driver); the returns go back by reference too."""
        self.phase("train", rank=self.rank, rollout_id=rollout_id)
        with (
            self._watch(f"the train step of rollout {rollout_id}"),
            span("train", cat="call", rollout_id=rollout_id),
        ):
            if values is None and update:  # every actor's call (a plugin actor may take no more)
                output = self.actor.train(rollout_id, batch)
            else:
                output = self.actor.train(rollout_id, batch, values=_merged(values or []), update=update)
        if output.returns is not None:
            output.returns = ray.put(output.returns)
        return output

    def values(self, rollout_id: int, batch: RolloutBatch) -> Any:
        """The critic: the values of this rank's samples, by reference (an ObjectRef of
        {sample index: values})."""
        with self._watch(f"the critic's values of rollout {rollout_id}"), span("values", cat="call"):
            return ray.put(self.actor.compute_values(batch))

    def train_values(
        self, rollout_id: int, batch: RolloutBatch, values: list[Any], returns: list[Any]
    ) -> TrainOutput:
        """The critic's steps on the returns the actor ranks computed (references, fetched here)."""
        with self._watch(f"the critic's train step of rollout {rollout_id}"), span("train", cat="call"):
            return self.actor.train_values(rollout_id, batch, _merged(values), _merged(returns))

    def save(self, rollout_id: int, path: str, extra: dict[str, Any] | None = None) -> str:
        self.phase("save", rank=self.rank, rollout_id=rollout_id)
        with span("save", cat="save", rollout_id=rollout_id):
            return self.actor.save(rollout_id, path, extra)

    def save_hf(self, path: str) -> None:
        self.actor.save_hf(path)

    def connect_engines(
        self, topology: PushTopology, push_fault: str | None = None, api_key: str | None = None
    ) -> None:
        """Every rank: the engines to push to, and how (`topology`, built once by the job); rank 0
        builds the bridge. Called again with the new topology when engines are replaced."""
        self.topology = topology
        if push_fault is not None:
            from slime.bridge.faults import PushFault

            self.fault = PushFault.parse(push_fault)
            self.fault.check(self.actor.weight_shapes())  # every rank: none is left in a gather
            logger.warning("--debug-push-fault %s: every weight push is broken on purpose", push_fault)
        if self.rank == 0:
            import functools

            if self.bridge is not None:  # engines were replaced: the old transport goes
                try:
                    run_sync(self.bridge.close())
                except Exception as e:  # an engine of the old set is down
                    logger.warning("closing the previous weight bridge: %s", e)

            from slime.bridge.bridge import WeightBridge
            from slime.engines.client import ClientConfig, EngineClient

            # Every engine call and the push group's collectives: --distributed-timeout-minutes.
            timeout_s = self.actor.cfg.distributed_timeout_minutes * 60
            client = functools.partial(
                EngineClient, config=ClientConfig(timeout_s=timeout_s, api_key=api_key)
            )
            self.bridge = WeightBridge.for_topology(topology, self.actor.cfg.hf_checkpoint, timeout_s, client)
            self.bridge.phase = self.phase
            group = (
                f", a group of {topology.world_size} with its master on {topology.master_address}"
                if topology.kind == "distributed"
                else ""
            )
            logger.info(
                "weight push: %s to %d engines on nodes %s (tensor-parallel sizes %s)%s",
                topology.label,
                len(topology.engines),
                [e.node for e in topology.engines],
                list(topology.tp_sizes),
                group,
            )

    def push_weights(
        self, weight_version: str, bucket_bytes: int, verify: bool = False
    ) -> dict[str, float | str] | None:
        """One push (every rank): the statistics on rank 0, with the transport's label under
        "transport"; None elsewhere."""
        from slime.bridge.push import push_actor_weights

        if self._keeps_old_actor():  # --keep-old-actor: the weights the engines generate with from now
            self.actor.keep_weights(weight_version)
        with self._watch(f"the weight push of version {weight_version}"), span("push", cat="push"):
            return push_actor_weights(
                self.actor, self.bridge, weight_version, bucket_bytes, self.fault, verify, self.topology
            )

    def dump_adapter(self, folders: list[str]) -> int:
        """--debug-sync-parameters-path with --lora-push adapter (every rank gathers): rank 0
        writes the adapter the push will send into each engine's `before` folder, in the engines'
        dtype, under the names the engines dump theirs (slime.utils.peft_files.dump_name)."""
        from slime.config.lora import ADAPTER_NAME
        from slime.utils.files import atomic_torch_save
        from slime.utils.peft_files import LORA_TENSOR, dump_name

        named, _ = self.actor.export_adapter()
        if self.rank != 0:
            return 0
        dtype = self.bridge.engine_dtype_once() if self.bridge is not None else None
        for folder in folders:
            os.makedirs(folder, exist_ok=True)
            for name, tensor in named:
                m = LORA_TENSOR.match(name)
                assert m is not None, name
                t = tensor.detach().to("cpu", dtype or tensor.dtype, copy=True)
                atomic_torch_save(t, os.path.join(folder, dump_name(ADAPTER_NAME, m.group(1), m.group(2))))
        return len(named)

    def sleep(self, keep_params: bool = False) -> None:
        with span("offload", cat="memory", keep_params=keep_params):
            self.actor.sleep(keep_params)

    def wake(self) -> None:
        with span("reload", cat="memory"):
            self.actor.wake()

    def close(self) -> None:
        if self.bridge is not None:
            run_sync(self.bridge.close())
        self.actor.close()


def _merged(refs: list[Any]) -> dict[int, list[float]]:
    """Per-sample values from every rank's answer (object references, or the dicts themselves)."""
    parts = ray.get([r for r in refs if isinstance(r, ray.ObjectRef)])
    parts += [r for r in refs if not isinstance(r, ray.ObjectRef)]
    return {k: v for part in parts for k, v in part.items()}


def engines_leave_loopback() -> bool:
    """Engines bind their node's address (reachable by anyone on that network) on a multi-node
    cluster or with SLIME_ENGINE_BIND_NODE_IP=1; on one machine they bind loopback."""
    return (
        bool(os.environ.get("SLIME_ENGINE_BIND_NODE_IP"))
        or len([n for n in ray.nodes() if n.get("Alive")]) > 1
    )


def engine_host() -> str:
    """Where an engine binds, so that the rollout manager and the trainer on other nodes reach it."""
    return node_ip() if engines_leave_loopback() else "127.0.0.1"


class EngineActor(Traced):
    """Owns one torch-engine server process on this actor's node (a Ray actor)."""

    def __init__(
        self,
        model_path: str,
        extra_args: list[str],
        log_path: str | None,
        api_key: str | None = None,
        debug_dump_dir: str | None = None,
    ):
        """`api_key`: what every request must carry (None: an engine on loopback needs none);
        `debug_dump_dir`: where /slime/dump_parameters may write (None: nowhere)."""
        from slime.engines.torch_engine.launcher import start_torch_engine

        self.proc = start_torch_engine(
            model_path,
            ["--host", engine_host(), *extra_args],
            log_path=log_path,
            api_key=api_key,
            debug_dump_dir=debug_dump_dir,
        )

    def url(self) -> str:
        return self.proc.url

    def node_ip(self) -> str:
        return node_ip()

    def trace_events(self) -> list[dict[str, Any]]:
        """This actor's events and its server's (the same node: the same clock)."""
        server = self.proc.trace_events()  # first: a failed call loses none of this process's
        return [*super().trace_events(), *server]

    def stop(self) -> int:
        return self.proc.stop()


class SGLangEngineActor(EngineActor):
    """Owns one SGLang server on the GPUs of its engine's bundles (a Ray actor; --rollout-backend
    sglang). The server is a child process that sees exactly `gpu_ids`."""

    def __init__(self, launch: dict[str, Any], gpu_ids: list[str] | None, log_path: str, timeout_s: float):
        from slime.engines.sglang_server import SGLangLaunch, start_sglang_server
        from slime.utils.net import free_port

        host = engine_host()
        settings = SGLangLaunch(host=host, port=free_port(host), nccl_port=free_port(host), **launch)
        logger.info("starting SGLang on GPUs %s: %s", gpu_ids, " ".join(settings.command()))
        self.proc = start_sglang_server(settings, gpu_ids, log_path, timeout_s)


@ray.remote(num_cpus=0)
def bundle_device() -> tuple[str, list[str]]:
    """(node address, GPU ids Ray gave this task): run once in each bundle to learn its GPU."""
    return node_ip(), [str(i) for i in ray.get_gpu_ids()]
