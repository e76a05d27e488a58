"""`tensor` transport on one host: buckets through one reused shared-memory file.

The bucket is copied into a shared-memory file that persists across buckets and pushes (copying
into already-touched memory is several times faster than into fresh pages), every engine gets
the same small JSON handle, and the next bucket overwrites the file only after every engine
answered. On GPU, SGLang's CUDA-IPC handles replace the file (the SGLang backend's part).
"""

from __future__ import annotations

import asyncio

from slime.bridge.base import Bucket
from slime.engines.client import EngineClient
from slime.utils.shm_tensors import SharedBuffer, pack_named_tensors


class TensorTransport:
    name = "tensor"

    def __init__(self) -> None:
        self.buffer: SharedBuffer | None = None

    async def setup(self, engines: list[EngineClient]) -> None:
        return None

    async def send(self, engines: list[EngineClient], bucket: Bucket, weight_version: str) -> None:
        handle, self.buffer = pack_named_tensors(bucket, self.buffer)
        await asyncio.gather(
            *(e.update_weights_from_tensor([handle], weight_version=weight_version) for e in engines)
        )

    async def finish(self, engines: list[EngineClient], weight_version: str) -> None:
        return None

    async def close(self, engines: list[EngineClient]) -> None:
        if self.buffer is not None:
            self.buffer.close()
            self.buffer = None
