"""`distributed` transport: broadcasts from trainer rank 0 over a process group with the engines.

Set-up joins trainer rank 0 (group rank 0, hosting the TCPStore on a port the OS picks) and
every engine (ranks 1..N) in one gloo (CPU) or NCCL (GPU) group through
/init_weights_update_group. Each bucket is announced to every engine with
/update_weights_from_distributed (names, dtypes, shapes) while rank 0 broadcasts the tensors in
that order; the bucket is done when every engine answered.
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

from slime.bridge.base import Bucket
from slime.engines.client import EngineClient
from slime.utils import distributed as sdist
from slime.utils.shm_tensors import dtype_to_str

GROUP_NAME = "slime_weight_update"


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class DistributedTransport:
    name = "distributed"
    session = True

    def __init__(self, backend: str = "gloo", master_address: str = "127.0.0.1", timeout_s: float = 600.0):
        self.backend = backend
        self.master_address = master_address
        self.timeout_s = timeout_s
        self.group: Any = None

    async def setup(self, engines: list[EngineClient]) -> None:
        port = free_port(self.master_address)
        world_size = 1 + len(engines)
        joins = [
            asyncio.create_task(
                e.init_weights_update_group(
                    self.master_address, port, rank_offset=1 + i, world_size=world_size,
                    group_name=GROUP_NAME, backend=self.backend,
                )
            )
            for i, e in enumerate(engines)
        ]  # fmt: skip
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
        finally:
            await asyncio.gather(*posts)

    async def finish(self, engines: list[EngineClient], weight_version: str) -> None:
        return None

    async def abort(self) -> None:
        return None  # every send completed before it returned

    async def close(self, engines: list[EngineClient]) -> None:
        if self.group is None:
            return
        await asyncio.gather(
            *(e.destroy_weights_update_group(GROUP_NAME) for e in engines), return_exceptions=True
        )
        self.group = None
