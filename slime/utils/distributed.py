"""Process groups that live outside torch.distributed's default group.

A weight-update group joins trainer rank 0 and the engine processes. Neither side may touch
the default group (the trainer already uses it for data parallelism; an engine may be re-joined
by a new trainer), so the group is built directly from a TCPStore: gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable
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


def init_train_group(
    device: str,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    timeout_minutes: float = 10.0,
) -> tuple[int, int]:
    """Join the trainer's default process group: gloo on CPU; on CUDA, NCCL for CUDA tensors and
    gloo for CPU tensors.

    Rank, world size and rendezvous come from the arguments or, when omitted, from the
    environment that torchrun and the Ray layer set (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT, LOCAL_RANK). Returns (rank, world_size).
    """
    import os

    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda was given but torch sees no CUDA device")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    if init_method is None and "MASTER_ADDR" not in os.environ:
        raise RuntimeError(
            "no rendezvous for the train process group: pass init_method or set MASTER_ADDR/MASTER_PORT"
        )
    if not dist.is_initialized():
        dist.init_process_group(
            # On CUDA, NCCL for CUDA tensors and gloo for CPU ones: metrics, whitening statistics
            # and object collectives are CPU tensors, which an NCCL-only group refuses.
            backend="cpu:gloo,cuda:nccl" if device == "cuda" else "gloo",
            init_method=init_method or "env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    return rank, world_size


def leave_train_group(teardown: Callable[[], None] | None = None) -> None:
    """Leave the process group together: a rank tearing gloo down while a peer still talks to it
    can abort the peer. `teardown` (megatron-core's parallel state) runs before the group goes;
    its failure does not keep the group."""
    if not dist.is_initialized():
        return
    try:
        dist.barrier()
    finally:
        if teardown is not None:
            with contextlib.suppress(Exception):
                teardown()
        dist.destroy_process_group()
