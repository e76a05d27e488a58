"""The weight-update bridge: when and in which order weights reach the engines.

One push, for every transport:

    pause generation → flush the KV cache → send every bucket → (the last request sets the
    new weight_version) → continue generation

Generation is paused before the first byte moves and continued only after every engine answered
for the last bucket, so no request ever runs on a mix of old and new weights, and every sample
finished after the push reports the new weight_version. Paused requests stay in the engine
(`in_place`) and continue with the new weights.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from slime.bridge.base import Bucket, Transport
from slime.bridge.topology import PushTopology
from slime.debug.phases import no_hook
from slime.engines.client import EngineClient, EngineError
from slime.utils.async_utils import run_sync
from slime.utils.job_trace import span

logger = logging.getLogger(__name__)

PushStats = dict[str, float | str]
"""A push's statistics: numbers, and the transport's label under "transport"."""


def make_transport(topology: PushTopology, hf_checkpoint: str, timeout_s: float = 600.0) -> Transport:
    """The transport `topology.kind` names. `hf_checkpoint` gives the disk transport's directories
    their config and tokenizer files; `timeout_s` bounds the trainer's side of the distributed
    transport's collectives."""
    kind = topology.kind
    if kind == "ipc":
        from slime.bridge.ipc import IpcTransport

        return IpcTransport(topology.tp_sizes)
    if kind == "shared_memory":
        from slime.bridge.tensor import TensorTransport

        return TensorTransport()
    if kind == "distributed":
        from slime.bridge.distributed import DistributedTransport

        assert topology.backend is not None
        return DistributedTransport(topology.backend, topology.master_address, timeout_s, topology.tp_sizes)
    if kind == "disk":
        d = topology.disk
        if d.mode == "delta":
            from slime.bridge.delta import DeltaDiskTransport

            assert d.disk_dir is not None and d.local_dir is not None  # the flags' rules
            return DeltaDiskTransport(hf_checkpoint, d.disk_dir, d.local_dir, d.encoding, d.checksum)
        from slime.bridge.disk import DiskTransport

        return DiskTransport(hf_checkpoint, root=d.disk_dir, keep_files=d.keep_files)
    raise ValueError(f"unknown transport kind {kind!r}")


class WeightBridge:
    """Pushes buckets into a fixed set of engines through one transport.

    Engine clients are opened per push (a push may run in a fresh event loop, e.g. inside a Ray
    actor method); the transport's state (a process group, a shared-memory file) persists.
    """

    def __init__(
        self,
        transport: Transport,
        engine_urls: list[str],
        make_client: Callable[[str], EngineClient] = EngineClient,
        label: str | None = None,
        pause_mode: str = "in_place",
        tp_sizes: Sequence[int] | None = None,
        sglang: bool = False,
    ):
        """`pause_mode`: how the push pauses requests in flight (SGLang's modes: in_place keeps
        them and their KV cache, retract recomputes their KV cache with the new weights, abort
        ends them with what they generated so far)."""
        self.transport = transport
        self.pause_mode = pause_mode
        self.engine_urls = list(engine_urls)
        self.make_client = make_client
        self.label = label or transport.name
        """The transport that runs (PushTopology.label), in every push's statistics."""
        self._ready = False
        self.phase: Callable[..., None] = no_hook
        """--debug-phase-hook: called with "push_bucket" after every bucket sent."""
        self._engine_dtype: tuple[Any] | None = None
        self.adapter_buffer: Any = None  # --lora-push adapter: its shared-memory file (slime.bridge.adapter)
        self.collected: dict[str, tuple[dict[str, Any], list[str]]] = {}
        self.tp_sizes = tuple(tp_sizes) if tp_sizes is not None else (1,) * len(self.engine_urls)
        """Each engine's tensor-parallel size (the adapter push sends one payload per TP rank)."""
        self.sglang = sglang
        """The engines are SGLang servers (the adapter push unloads before it loads)."""

    @classmethod
    def for_topology(
        cls,
        topology: PushTopology,
        hf_checkpoint: str,
        timeout_s: float = 600.0,
        make_client: Callable[[str], EngineClient] = EngineClient,
    ) -> WeightBridge:
        """The bridge into the topology's engines through its transport (make_transport)."""
        transport = make_transport(topology, hf_checkpoint, timeout_s)
        return cls(
            transport,
            topology.urls,
            make_client,
            topology.label,
            topology.pause_mode,
            topology.tp_sizes,
            topology.sglang,
        )

    async def push(self, buckets: Iterable[Bucket], weight_version: str, collect: bool = False) -> PushStats:
        """Run one update; returns {"bytes", "seconds", "buckets"} (floats) and "transport" (the
        label of the transport that ran, a string). With `collect`, the engines' fingerprints of
        what they wrote are left in `collected` (url -> (fingerprints, names))."""
        engines = [self.make_client(u) for u in self.engine_urls]
        for e in engines:
            e.update_fingerprints = {} if collect else None
        try:
            stats = await self._push(engines, buckets, weight_version)
            if collect:
                self.collected = {
                    e.base_url: (e.update_fingerprints or {}, e.parameter_names or []) for e in engines
                }
            return stats
        finally:
            await asyncio.gather(*(e.close() for e in engines))

    async def _push(
        self, engines: list[EngineClient], buckets: Iterable[Bucket], weight_version: str
    ) -> PushStats:
        if not self._ready:
            await self.transport.setup(engines)
            self._ready = True
        start = time.perf_counter()
        total = count = 0
        with span("pause generation", cat="push", mode=self.pause_mode):
            await asyncio.gather(*(e.pause_generation(self.pause_mode) for e in engines))
        sessions: list[EngineClient] = []
        try:
            await asyncio.gather(*(_flush(e) for e in engines))
            if self.transport.session:  # engines without sessions answer 404 and get none
                opened = await asyncio.gather(*(e.begin_weight_update() for e in engines))
                sessions = [e for e, ok in zip(engines, opened, strict=True) if ok]
            try:
                for bucket in buckets:
                    size = sum(t.numel() * t.element_size() for _, t in bucket)
                    with span(f"bucket {count}", cat="bucket", bytes=size, tensors=len(bucket)):
                        await self.transport.send(engines, bucket, weight_version)
                    total += size
                    count += 1
                    self.phase(
                        "push_bucket",
                        version=weight_version,
                        bucket=count - 1,
                        engines=list(self.engine_urls),
                        transport=self.label,
                    )
                await self.transport.finish(engines, weight_version)
            except BaseException:
                await self.transport.abort()
                self._ready = False  # a transport that failed half way is set up again
                raise
        finally:
            try:
                await _all(sessions, "end_weight_update")
            finally:
                with span("continue generation", cat="push"):
                    await _all(engines, "continue_generation")
        seconds = time.perf_counter() - start
        logger.info(
            "pushed %d buckets, %.1f MB, weight_version %s via %s in %.3f s",
            count,
            total / 1e6,
            weight_version,
            self.label,
            seconds,
        )
        return {"bytes": float(total), "seconds": seconds, "buckets": float(count), "transport": self.label}

    def engine_dtype_once(self) -> Any:
        """engine_dtype() from synchronous code, asked once (an event loop per push would cost
        more than the check itself)."""
        if self._engine_dtype is None:
            run_sync(self.engine_dtype())
        assert self._engine_dtype is not None
        return self._engine_dtype[0]

    async def engine_dtype(self) -> Any:
        """The parameter dtype of the engines (SGLang's /get_server_info `dtype`), asked once."""
        import torch

        if self._engine_dtype is not None:
            return self._engine_dtype[0]
        engine = self.make_client(self.engine_urls[0])
        try:
            info = await engine.get_server_info()
        finally:
            await engine.close()
        name = str(info.get("dtype", "float32")).removeprefix("torch.")
        self._engine_dtype = (getattr(torch, name, None) if name != "auto" else None,)
        return self._engine_dtype[0]

    def verify(self, expected: dict[str, dict[str, Any]], weight_version: str, sent: set[str]) -> None:
        """--check-weight-sync after a `collect` push: every engine's fingerprints of what it
        wrote against the trainer's; raises WeightSyncError naming the tensors."""
        from slime.bridge import verify

        for url, (written, held) in self.collected.items():
            lines = verify.compare(expected, written, held, sent)
            if lines:
                raise verify.WeightSyncError(verify.report(weight_version, url, lines))

    async def close(self) -> None:
        if self.adapter_buffer is not None:
            self.adapter_buffer.close()
            self.adapter_buffer = None
        engines = [self.make_client(u) for u in self.engine_urls]
        try:
            await self.transport.close(engines)
        finally:
            await asyncio.gather(*(e.close() for e in engines))


async def _all(engines: list[EngineClient], method: str) -> None:
    await asyncio.gather(*(getattr(e, method)() for e in engines))


async def _flush(engine: EngineClient) -> None:
    """Flush the KV cache; an engine holding paused requests keeps theirs (they resume with the
    new weights, as in SGLang's in-place pause)."""
    try:
        await engine.flush_cache()
    except EngineError as e:
        if e.status != 400:
            raise
        logger.info("%s kept its KV cache: %s", engine.base_url, e)
