"""What a weight transport does; the bridge (bridge.py) decides when."""

from __future__ import annotations

from typing import Protocol

import torch

from slime.engines.client import EngineClient

Bucket = list[tuple[str, torch.Tensor]]


class Transport(Protocol):
    """Moves buckets of (HF name, full tensor) from trainer rank 0 into every engine.

    `send` returns once the caller may reuse the bucket's memory (the transport copied or
    delivered it); `finish` returns once every engine has applied every bucket of the push.
    """

    name: str
    session: bool
    """Whether its updates run inside SGLang's weight-update session (/begin_weight_update ...
    /end_weight_update; required for tensor and distributed updates since SGLang 0.5.2x)."""

    async def setup(self, engines: list[EngineClient]) -> None:
        """Once, before the first push (e.g. join a process group)."""
        ...

    async def send(self, engines: list[EngineClient], bucket: Bucket, weight_version: str) -> None: ...

    async def finish(self, engines: list[EngineClient], weight_version: str) -> None:
        """After the last bucket of a push (e.g. the disk transport's single load)."""
        ...

    async def abort(self) -> None:
        """After a failed push: wait for whatever the transport still has in flight."""
        ...

    async def close(self, engines: list[EngineClient]) -> None: ...
