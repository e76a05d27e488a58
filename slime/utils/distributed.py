"""Process groups that live outside torch.distributed's default group.

A weight-update group joins trainer rank 0 and the engine processes. Neither side may touch
the default group (the trainer already uses it for data parallelism; an engine may be re-joined
by a new trainer), so the group is built directly from a TCPStore: gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist


def new_group(
    backend: str, master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float = 300.0
) -> Any:
    """Create (rank 0 hosts the store) or join a stand-alone process group.

    Args:
        backend: "gloo" or "nccl".
        master_address, master_port: where rank 0's TCPStore listens.
        rank, world_size: this process's rank in the new group and the group size.
        timeout_s: rendezvous and collective timeout.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    raise ValueError(f"unknown process-group backend {backend!r}; use 'gloo' or 'nccl'")


def broadcast(group: Any, tensor: torch.Tensor, root: int = 0) -> None:
    """Blocking broadcast of `tensor` from `root` over a group made by `new_group`."""
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    group.broadcast([tensor], opts).wait()


def destroy_group(group: Any, abort: bool = False) -> None:
    """Shut down a group made by `new_group`; its connections close when the last reference goes.

    Args:
        abort: the group may be stuck in a collective (a receive failed half way). NCCL then
            aborts its communicators rather than wait on them; gloo always shuts down, since
            an aborted gloo group can crash the process at exit.
    """
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    use_abort = abort and nccl is not None and isinstance(group, nccl)
    stop = getattr(group, "abort" if use_abort else "shutdown", None)
    if stop is not None:
        stop()
