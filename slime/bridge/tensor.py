"""`tensor` transport on one host: buckets through reused shared-memory files, double-buffered.

A bucket is copied into a shared-memory file that persists across buckets and pushes (copying
into already-touched memory is several times faster than into fresh pages) and every engine gets
the same small JSON handle. Two files alternate: while the engines copy bucket k out of one, the
trainer packs bucket k+1 into the other, so the two copies overlap instead of adding up. A file
is overwritten only after every engine answered for the bucket it held. On GPU, SGLang's
CUDA-IPC handles replace the files (the SGLang backend's part).
"""

from __future__ import annotations

import asyncio
from typing import Any

from slime.bridge.base import Bucket
from slime.engines.client import EngineClient
from slime.utils.shm_tensors import SharedBuffer, pack_named_tensors


class TensorTransport:
    name = "tensor"
    session = True

    def __init__(self, num_buffers: int = 2) -> None:
        if num_buffers < 1:
            raise ValueError("the tensor transport needs at least one shared-memory buffer")
        self.buffers: list[SharedBuffer | None] = [None] * num_buffers
        self.in_flight: list[asyncio.Future[Any] | None] = [None] * num_buffers
        self.sent = 0

    async def setup(self, engines: list[EngineClient]) -> None:
        return None

    async def send(self, engines: list[EngineClient], bucket: Bucket, weight_version: str) -> None:
        slot = self.sent % len(self.buffers)
        self.sent += 1
        try:
            previous = self.in_flight[slot]
            if previous is not None:
                self.in_flight[slot] = None
                await previous  # every engine has copied the bucket this file held
            # Packing runs in a thread (torch's copy releases the GIL), so the event loop keeps
            # serving the other buffer's requests meanwhile.
            handle, self.buffers[slot] = await asyncio.to_thread(
                pack_named_tensors, bucket, self.buffers[slot]
            )
        except BaseException:
            await self.abort()
            raise
        self.in_flight[slot] = asyncio.ensure_future(
            asyncio.gather(
                *(e.update_weights_from_tensor([handle], weight_version=weight_version) for e in engines)
            )
        )

    async def finish(self, engines: list[EngineClient], weight_version: str) -> None:
        pending = [f for f in self.in_flight if f is not None]
        self.in_flight = [None] * len(self.buffers)
        self.sent = 0
        try:
            await asyncio.gather(*pending)
        except BaseException:
            await asyncio.gather(*pending, return_exceptions=True)
            raise

    async def abort(self) -> None:
        """Wait for every request still using a buffer (after a failure), ignoring their errors."""
        pending = [f for f in self.in_flight if f is not None]
        self.in_flight = [None] * len(self.buffers)
        self.sent = 0
        await asyncio.gather(*pending, return_exceptions=True)

    async def close(self, engines: list[EngineClient]) -> None:
        await self.abort()
        for i, buffer in enumerate(self.buffers):
            if buffer is not None:
                buffer.close()
                self.buffers[i] = None
