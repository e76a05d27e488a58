"""`distributed` transport: broadcasts from trainer rank 0 over a process group with the engines.

Set-up joins trainer rank 0 (group rank 0, hosting the TCPStore on its node's address and a port
the OS picks) and every engine GPU in one gloo (CPU) or NCCL (GPU) group through
/init_weights_update_group: an engine of tensor-parallel size tp joins tp members, its TP worker k
as rank `rank_offset + k` (SGLang's rule), so the offsets are cumulative TP sizes and the group has
1 + the sum of the TP sizes members (slime.bridge.topology.group_layout). Before joining, each
engine's reported `tp_size` (/server_info) is checked against the topology: a group of the wrong
size would otherwise hang in its rendezvous until the timeout.

Each bucket is announced to every engine with /update_weights_from_distributed (names, dtypes,
shapes) while rank 0 broadcasts the tensors in that order (every TP worker receives every tensor
whole); the bucket is done when every engine answered.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from slime.bridge.base import Bucket
from slime.bridge.topology import LOOPBACK, group_layout
from slime.config.rollout import TopologyError
from slime.engines.client import EngineClient, EngineError
from slime.utils import distributed as sdist
from slime.utils.net import free_port
from slime.utils.shm_tensors import dtype_to_str

GROUP_NAME = "slime_weight_update"


class DistributedTransport:
    name = "distributed"
    session = True

    def __init__(
        self,
        backend: str = "gloo",
        master_address: str = LOOPBACK,
        timeout_s: float = 600.0,
        tp_sizes: Sequence[int] | None = None,
    ):
        """Args:
        backend: gloo or nccl.
        master_address: train rank 0's node address (PushTopology.master_address).
        timeout_s: the trainer's rendezvous and broadcast timeout.
        tp_sizes: each engine's tensor-parallel size, in the bridge's engine order (None: 1 each).
        """
        self.backend = backend
        self.master_address = master_address
        self.timeout_s = timeout_s
        self.tp_sizes = None if tp_sizes is None else tuple(tp_sizes)
        self.group: Any = None

    async def setup(self, engines: list[EngineClient]) -> None:
        sizes = self.tp_sizes if self.tp_sizes is not None else (1,) * len(engines)
        if len(sizes) != len(engines):
            raise TopologyError(f"{len(sizes)} tensor-parallel sizes for {len(engines)} engines")
        await asyncio.gather(*(_check_tp_size(e, tp) for e, tp in zip(engines, sizes, strict=True)))
        world_size, offsets = group_layout(sizes)
        try:
            port = free_port(self.master_address)
        except OSError as e:
            raise TopologyError(
                f"train rank 0 cannot listen on {self.master_address} ({e}): the push topology's master "
                "address must be the address of train rank 0's node"
            ) from None
        joins = [
            asyncio.create_task(
                e.init_weights_update_group(
                    self.master_address,
                    port,
                    rank_offset=offset,
                    world_size=world_size,
                    group_name=GROUP_NAME,
                    backend=self.backend,
                )
            )
            for e, offset in zip(engines, offsets, strict=True)
        ]
        try:
            self.group = await asyncio.to_thread(
                sdist.new_group, self.backend, self.master_address, port, 0, world_size, self.timeout_s
            )
        finally:
            await asyncio.gather(*joins)

    async def send(self, engines: list[EngineClient], bucket: Bucket, weight_version: str) -> None:
        if self.group is None:
            raise RuntimeError("the distributed transport was not set up (call setup first)")
        names = [n for n, _ in bucket]
        dtypes = [dtype_to_str(t.dtype) for _, t in bucket]
        shapes = [list(t.shape) for _, t in bucket]
        posts = [
            asyncio.create_task(
                e.update_weights_from_distributed(
                    names, dtypes, shapes, GROUP_NAME, weight_version=weight_version
                )
            )
            for e in engines
        ]

        def broadcast_all() -> None:
            for _, tensor in bucket:
                sdist.broadcast(self.group, tensor.detach().contiguous(), root=0)

        try:
            await asyncio.to_thread(broadcast_all)
        except BaseException:
            # An engine left the group half way (it died): shut the trainer's side down, so the
            # engines still receiving fail at once instead of waiting for the rest until the timeout.
            await self.abort()
            await asyncio.gather(*posts, return_exceptions=True)
            raise
        await asyncio.gather(*posts)

    async def finish(self, engines: list[EngineClient], weight_version: str) -> None:
        return None

    async def abort(self) -> None:
        """After a failure: the group cannot be trusted any more (setup() builds a new one)."""
        if self.group is not None:
            group, self.group = self.group, None
            await asyncio.to_thread(sdist.destroy_group, group, True)

    async def close(self, engines: list[EngineClient]) -> None:
        if self.group is None:
            return
        await asyncio.gather(
            *(e.destroy_weights_update_group(GROUP_NAME) for e in engines), return_exceptions=True
        )
        self.group = None


async def _check_tp_size(engine: EngineClient, expected: int) -> None:
    """Refuse an engine whose reported tensor-parallel size is not the topology's (an engine that
    reports none, or has no /server_info, is taken at the topology's word)."""
    try:
        info = await engine.get_server_info()
    except EngineError as e:
        if e.status != 404:
            raise
        return
    reported = info.get("tp_size") if isinstance(info, dict) else None
    if reported is not None and int(reported) != expected:
        raise TopologyError(
            f"engine {engine.base_url} reports tensor-parallel size {reported}, but the push topology "
            f"gives it {expected}: its TP workers would join a weight-update group sized for {expected}; "
            f"set --rollout-num-gpus-per-engine {reported} (or launch the engine with tensor-parallel size "
            f"{expected})"
        )
