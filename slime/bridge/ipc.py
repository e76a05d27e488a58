"""`tensor` transport by handle: each bucket flattened into one byte buffer per train rank and
shared with the engines as SGLang's `load_format="flattened_bucket"` payload.

On GPU (colocated) this is the CUDA-IPC push: engine j's tensor-parallel rank k sits on the GPU of
train rank o_j + k, where o_j = tp_0 + ... + tp_(j-1) sums the TP sizes of the engines before it
(slime.bridge.topology checks the nodes), so every train rank shares its own copy of the bucket
(all-gathered already) and rank 0 sends engine j the payloads of ranks o_j .. o_j+tp_j-1, one per
TP rank, in TP order, as SGLang expects (`serialized_named_tensors[tp_rank]`). On CPU the same
code shares the buffer through a shared-memory file (torch's `file_system` strategy), which lets
the torch engine and the tests run this path for real; only the CUDA handle itself needs a GPU.

The payload is SGLang's `flattened_bucket` format (slime.utils.flattened_bucket). For SGLang
engines the trainer applies SGLang's own `monkey_patch_torch_reductions` (imported lazily) so
CUDA handles carry the device UUID, which SGLang maps to its local index.

A rank's buffer is dropped (GPU) or overwritten by the next bucket (CPU: one shared-memory file
per push) only after every engine answered for the bucket, a barrier that rank 0 reaches once its
requests returned; so one bucket per rank is shared at a time.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from slime.bridge.base import Bucket
from slime.engines.client import EngineClient
from slime.utils.flattened_bucket import LOAD_FORMAT, flat_size, flatten, serialize


def share_buckets(
    buckets: Iterable[Bucket], transport: IpcTransport | None, sglang_reductions: bool
) -> Iterator[Bucket]:
    """Every train rank: share each bucket's buffer; rank 0 (the one with `transport`) gets all
    ranks' payloads for the bucket it is about to send. Collective: every rank must iterate."""
    import torch.distributed as dist

    from slime.utils.shm_tensors import SharedBuffer

    world = dist.get_world_size() if dist.is_initialized() else 1
    shared: SharedBuffer | None = None  # CPU: one file for the push, reused bucket after bucket
    try:
        for bucket in buckets:
            nbytes = flat_size(bucket)
            if (
                bool(bucket)
                and bucket[0][1].device.type == "cpu"
                and (shared is None or shared.nbytes < nbytes)
            ):
                if shared is not None:
                    shared.close()
                shared = SharedBuffer.create(max(nbytes, 1))
            flat, metadata = flatten(bucket, shared.data if shared is not None else None)
            payload = serialize(
                flat, metadata, sglang_reductions, shared.path if shared is not None else None
            )
            gathered: list[Any] | None = [None] * world if transport is not None else None
            if world > 1:
                dist.gather_object(payload, gathered, dst=0)
            elif gathered is not None:
                gathered[0] = payload
            if transport is not None:
                transport.payloads = [str(p) for p in gathered or []]
            yield bucket  # rank 0: sent and answered by every engine when this resumes
            if world > 1:
                dist.barrier()  # now no engine reads this rank's buffer any more
            del flat
            if shared is None and torch.cuda.is_available():
                torch.cuda.ipc_collect()
    finally:
        if shared is not None:
            shared.close()


def split_by_engine(payloads: list[str], tp_sizes: Sequence[int], what: str) -> list[list[str]]:
    """Every train rank's payload of `what`, in rank order, split into each engine's TP ranks'
    (engine j gets those of ranks o_j .. o_j+tp_j-1)."""
    if len(payloads) < sum(tp_sizes):
        raise RuntimeError(
            f"{len(payloads)} train ranks shared {what}, but {len(tp_sizes)} engines of tensor-parallel "
            f"sizes {list(tp_sizes)} need one per engine GPU (the CUDA-IPC push is for --colocate)"
        )
    starts = itertools.accumulate(tp_sizes, initial=0)
    return [payloads[o : o + tp] for o, tp in zip(starts, tp_sizes)]


class IpcTransport:
    """Rank 0's side: sends engine j the payloads of its TP ranks and waits for every answer."""

    name = "tensor"
    session = True

    def __init__(self, tp_sizes: Sequence[int] | None = None) -> None:
        """`tp_sizes`: each engine's tensor-parallel size, in the bridge's engine order (None: 1 each)."""
        self.tp_sizes = None if tp_sizes is None else tuple(tp_sizes)
        self.payloads: list[str] = []

    async def setup(self, engines: list[EngineClient]) -> None:
        return None

    async def send(self, engines: list[EngineClient], bucket: Bucket, weight_version: str) -> None:
        sizes = self.tp_sizes if self.tp_sizes is not None else (1,) * len(engines)
        if len(sizes) != len(engines):
            raise RuntimeError(f"{len(sizes)} tensor-parallel sizes for {len(engines)} engines")
        per_engine = split_by_engine(self.payloads, sizes, "the bucket")
        self.payloads = []
        await asyncio.gather(
            *(
                e.update_weights_from_tensor(p, load_format=LOAD_FORMAT, weight_version=weight_version)
                for e, p in zip(engines, per_engine)
            )
        )

    async def finish(self, engines: list[EngineClient], weight_version: str) -> None:
        return None

    async def abort(self) -> None:
        self.payloads = []

    async def close(self, engines: list[EngineClient]) -> None:
        self.payloads = []
