"""The push topology: which engines a weight push reaches, through which transport, from where.

Built once at start-up from plain values (the flags, and the nodes placement put each process on)
and handed to every piece of the push: `make_transport` picks the transport from `kind`, the
`distributed` transport sizes its group from the engines' tensor-parallel sizes, and every train
rank learns from `every_rank_shares` whether it shares its own copy of each bucket (the CUDA-IPC
push), by the rule "`tensor` on CUDA is CUDA IPC" (`resolve_kind`, slime.config.rollout).

A weight-update group (`distributed`) has one member per engine GPU: SGLang's model runner joins
each TP worker as rank `rank_offset + tp_rank`, and every worker receives every broadcast tensor.
So engine j, of TP size tp_j, gets `rank_offset = 1 + tp_0 + ... + tp_(j-1)`, the group has
`1 + sum(tp_j)` members, and rank 0 is train rank 0, whose node address is the group's master
address (the engines on other nodes connect to it).

The flag rules (`resolve_kind`, `default_transport`, `transport_problem`) are the config layer's
(slime.config.rollout), which checks them at parse time; this module has no heavy imports either.
"""

from __future__ import annotations

import ipaddress
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from slime.config.rollout import TopologyError, resolve_kind, transport_problem

LOOPBACK = "127.0.0.1"

KINDS = ("shared_memory", "ipc", "distributed", "disk")
"""How a push runs: `shared_memory` (tensor on CPU: one shared-memory file per bucket, read by every
engine), `ipc` (tensor on CUDA: every train rank shares its copy by CUDA-IPC handle, the engine GPU
on that rank's GPU opens it; on CPU the same code shares files, which the tests use), `distributed`
(broadcasts from train rank 0 over a gloo or NCCL group), `disk` (a safetensors directory)."""


def group_layout(tp_sizes: Sequence[int]) -> tuple[int, tuple[int, ...]]:
    """(world size, each engine's rank offset) of a weight-update group: train rank 0 is rank 0,
    engine j's TP worker k is rank `1 + tp_0 + ... + tp_(j-1) + k`."""
    offsets = tuple(1 + s for s in itertools.accumulate(tp_sizes, initial=0))
    return 1 + sum(tp_sizes), offsets[:-1]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def same_node(a: str, b: str) -> bool:
    """Two node addresses name one node when equal, or when one is 127.0.0.1/localhost ("this
    machine", the default where no node is known) and the other is loopback too. Two other
    loopback addresses are distinct Ray nodes (Ray rewrites a node address of 127.0.0.1 to the
    machine's, so test clusters put their nodes on 127.0.0.2, 127.0.0.3, ...)."""
    local = (LOOPBACK, "localhost")
    return a == b or (a in local and is_loopback(b)) or (b in local and is_loopback(a))


@dataclass(frozen=True)
class EngineSpec:
    url: str
    """Empty while the engine is only planned (the placement check before anything starts)."""
    tp_size: int = 1
    """Tensor-parallel size: the engine's GPUs, each one member of a weight-update group."""
    node: str = LOOPBACK
    """IP address of the node the engine runs on."""

    def name(self, j: int) -> str:
        """How messages name engine `j`."""
        return f"engine {j} ({self.url})" if self.url else f"engine {j}"


@dataclass(frozen=True)
class DiskSettings:
    """The disk transport's flags: --update-weight-mode, --update-weight-disk-dir,
    --update-weight-local-checkpoint-dir, --update-weight-delta-encoding / -checksum,
    --update-weight-disk-keep-files."""

    mode: str = "full"
    disk_dir: str | None = None
    local_dir: str | None = None
    encoding: str = "xor"
    checksum: str = "xxh3-128"
    keep_files: bool = False


@dataclass(frozen=True)
class PushTopology:
    """Engines, train ranks and transport of the weight push; validated when built."""

    transport: str
    """`--update-weight-transport` as given: tensor, distributed or disk (or ipc, see KINDS)."""
    device: str
    """cpu or cuda: the train ranks' and engines' device (gloo or NCCL for `distributed`)."""
    engines: tuple[EngineSpec, ...]
    """In the order the rollout manager and the bridge list them."""
    train_nodes: tuple[str, ...]
    """IP address of each train rank's node, by rank. train_nodes[0] is the master address."""
    sglang: bool = False
    """The engines are SGLang servers (the CUDA-IPC push then uses SGLang's torch reductions)."""
    colocated: bool = False
    """The engines run on the train ranks' GPUs (--colocate): engine GPU i is train rank i's."""
    pause_mode: str = "in_place"
    """How a push pauses the requests in flight (SGLang's /pause_generation modes): only the
    continuous schedule pushes with requests in flight (--pause-generation-mode)."""
    disk: DiskSettings = DiskSettings()
    """The disk transport's settings (full or delta, its directories)."""
    kind: str = field(init=False)
    """The transport as it runs (KINDS), resolved from `transport` and `device`."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", resolve_kind(self.transport, self.device))
        problem = self._problem()
        if problem is not None:
            raise TopologyError(problem)

    @property
    def master_address(self) -> str:
        """Where the weight-update group's store listens: train rank 0's node."""
        return self.train_nodes[0]

    @property
    def backend(self) -> str | None:
        """The `distributed` group's backend; None for the other transports."""
        if self.kind != "distributed":
            return None
        return "nccl" if self.device == "cuda" else "gloo"

    @property
    def label(self) -> str:
        """The transport that ran, for logs and metrics: shared_memory, cuda_ipc, cpu_ipc,
        distributed_gloo, distributed_nccl or disk."""
        if self.kind == "ipc":
            return "cuda_ipc" if self.device == "cuda" else "cpu_ipc"
        if self.kind == "distributed":
            return f"distributed_{self.backend}"
        if self.kind == "disk" and self.disk.mode == "delta":
            return "disk_delta"
        return self.kind

    @property
    def every_rank_shares(self) -> bool:
        """Every train rank takes part in each push (shares its own copy of every bucket)."""
        return self.kind == "ipc"

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.engines]

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        return tuple(e.tp_size for e in self.engines)

    @property
    def world_size(self) -> int:
        """Members of the `distributed` transport's group: train rank 0 and every engine GPU."""
        return group_layout(self.tp_sizes)[0]

    @property
    def rank_offsets(self) -> tuple[int, ...]:
        """Each engine's `rank_offset` in the `distributed` transport's group."""
        return group_layout(self.tp_sizes)[1]

    def _problem(self) -> str | None:
        if self.device not in ("cpu", "cuda"):
            return f"--device must be cpu or cuda, got {self.device!r}"
        if not self.engines:
            return "a weight push needs at least one engine"
        if not self.train_nodes:
            return "a weight push needs at least one train rank"
        for j, e in enumerate(self.engines):
            if not isinstance(e.tp_size, int) or e.tp_size < 1:
                return (
                    f"{e.name(j)} has tensor-parallel size {e.tp_size!r}: "
                    "--rollout-num-gpus-per-engine must be >= 1"
                )
        seen = [u for u in self.urls if u and self.urls.count(u) > 1]
        if seen:
            return f"engine {seen[0]} is listed twice: every engine gets each push once"
        flags = transport_problem(self.transport, self.device, self.colocated)
        if flags is not None:
            return flags
        if self.kind == "ipc":
            return self._ipc_problem()
        master = self.master_address
        away = [(j, e) for j, e in enumerate(self.engines) if not same_node(e.node, master)]
        if not away or (self.kind == "disk" and self.disk.disk_dir):  # a directory every host reads
            return None
        j, e = away[0]
        where = f"{e.name(j)} runs on node {e.node}, not on train rank 0's node {master}"
        if self.kind == "shared_memory":
            return (
                f"--update-weight-transport tensor on CPU passes shared-memory files, which only engines on "
                f"train rank 0's node can open: {where}; use --update-weight-transport distributed"
            )
        if self.kind == "disk":
            return (
                "--update-weight-transport disk writes the weights to a temporary directory on train rank "
                f"0's node: {where}; give --update-weight-disk-dir on a filesystem every node shares, or "
                "use --update-weight-transport distributed"
            )
        if master in (LOOPBACK, "localhost"):  # "this machine": no node address was given
            return (
                f"--update-weight-transport distributed: the group's master address {master} is loopback, "
                f"which {where} cannot reach; give train rank 0's node IP address as its node"
            )
        return None

    def _ipc_problem(self) -> str | None:
        """Engine j's TP worker k opens the buffer of the train rank on its GPU, rank offset_j + k."""
        num_gpus = sum(self.tp_sizes)
        if len(self.train_nodes) < num_gpus:
            return (
                f"--update-weight-transport {self.transport} ({self.label}) feeds every engine GPU from "
                f"the train rank on that GPU: the engines have {num_gpus} GPUs (tensor-parallel sizes "
                f"{list(self.tp_sizes)}) but there are {len(self.train_nodes)} train ranks; with "
                "--colocate give the engines as many GPUs as train ranks, or use "
                "--update-weight-transport distributed"
            )
        for j, (e, offset) in enumerate(zip(self.engines, group_layout(self.tp_sizes)[1], strict=True)):
            for rank in range(offset - 1, offset - 1 + e.tp_size):
                if not same_node(self.train_nodes[rank], e.node):
                    return (
                        f"--update-weight-transport {self.transport} ({self.label}) needs each engine on "
                        f"the node of the train ranks that feed it: {e.name(j)} runs on node {e.node}, but "
                        f"train rank {rank} runs on node {self.train_nodes[rank]}; use "
                        "--update-weight-transport distributed"
                    )
        return None


def build_topology(
    transport: str,
    device: str,
    engine_urls: Sequence[str],
    tp_sizes: int | Sequence[int] = 1,
    engine_nodes: Sequence[str] | None = None,
    train_nodes: Sequence[str] = (LOOPBACK,),
    sglang: bool = False,
    colocated: bool = False,
    pause_mode: str = "in_place",
    disk: DiskSettings | None = None,
) -> PushTopology:
    """The push topology from plain values; TopologyError when it cannot work.

    Args:
        transport: --update-weight-transport (tensor, distributed, disk; or ipc).
        device: cpu or cuda.
        engine_urls: every engine, in the rollout manager's order ("" for an engine not started yet).
        tp_sizes: each engine's tensor-parallel size, or one size for all.
        engine_nodes: each engine's node IP address; by default the host of its URL, a loopback
            host meaning train rank 0's node.
        train_nodes: each train rank's node IP address, by rank (train_nodes[0]: the master).
        sglang: the engines are SGLang servers.
        colocated: the engines run on the train ranks' GPUs (--colocate).
    """
    urls = list(engine_urls)
    sizes = [tp_sizes] * len(urls) if isinstance(tp_sizes, int) else list(tp_sizes)
    train = tuple(train_nodes)
    if len(sizes) != len(urls):
        raise TopologyError(f"{len(sizes)} tensor-parallel sizes for {len(urls)} engines")
    if engine_nodes is None:
        master = train[0] if train else LOOPBACK
        hosts = [urlsplit(u).hostname or LOOPBACK for u in urls]
        nodes = [master if is_loopback(h) else h for h in hosts]
    else:
        nodes = list(engine_nodes)
        if len(nodes) != len(urls):
            raise TopologyError(f"{len(nodes)} engine nodes for {len(urls)} engines")
    engines = tuple(EngineSpec(u, s, n) for u, s, n in zip(urls, sizes, nodes, strict=True))
    return PushTopology(
        transport, device, engines, train, sglang, colocated, pause_mode, disk or DiskSettings()
    )
