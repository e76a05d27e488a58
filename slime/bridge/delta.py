"""`--update-weight-mode delta`: each push publishes only what changed since the last one, as
slime's delta disk sync (the format: slime.utils.weight_delta).

The trainer keeps the raw bytes of every tensor as the engines hold them (seeded from
--hf-checkpoint, the engines' starting weights). A push diffs each tensor against them, writes the
changed ones (xor or overwrite, zstd-compressed, with the checksum of their new bytes) as version
N under --update-weight-disk-dir, then asks every engine to /pull_weights N into its host's
--update-weight-local-checkpoint-dir and reload it with /update_weights_from_disk. A version is
written under a temporary name and renamed when complete, so an engine never reads half of one;
the trainer's copy moves to the new bytes only once the version is published.

A transport built afresh (the job's start, a bridge rebuilt after engines left or joined), or one
whose version an engine refused (a checksum failed: the engine keeps serving the previous
version), clears the directory and starts from --hf-checkpoint again: its version 1 holds
everything trained so far, and every host re-seeds its checkpoint from the engine's model first.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from typing import Any

import numpy as np
import torch

from slime.bridge.base import Bucket
from slime.engines.client import EngineClient
from slime.utils import weight_delta as wd


class DeltaDiskTransport:
    name = "disk"
    session = False

    def __init__(
        self,
        hf_checkpoint: str,
        disk_dir: str,
        local_dir: str,
        encoding: str = "xor",
        checksum: str = "xxh3-128",
    ):
        self.hf_checkpoint, self.disk_dir, self.local_dir = hf_checkpoint, disk_dir, local_dir
        self.encoding, self.checksum = encoding, checksum
        self.version = 0
        """The newest version published."""
        self.snapshot: dict[str, np.ndarray] | None = None
        self.kinds: dict[str, tuple[str, tuple[int, ...]]] = {}
        """Each checkpoint tensor's dtype and shape: the pushed tensors are cast to it."""
        self.staged: dict[str, np.ndarray] = {}
        self.pending: str | None = None
        self.files: list[tuple[str, list[str]]] = []
        self.stats: dict[str, float] = {}
        """The last push's: bytes written, tensors changed, seconds to encode and to apply."""

    async def setup(self, engines: list[EngineClient]) -> None:
        if self.snapshot is None:  # a fresh stream: an older run's versions had another base
            os.makedirs(self.disk_dir, exist_ok=True)
            for name in wd.owned_entries(self.disk_dir):  # only what a stream wrote: never other files
                shutil.rmtree(os.path.join(self.disk_dir, name), ignore_errors=True)
            self.snapshot, self.kinds = await asyncio.to_thread(wd.seed_snapshot, self.hf_checkpoint)
        # Every host seeds its checkpoint now, so the first push pays only the delta.
        await asyncio.gather(*(e.pull_weights(self.local_dir, self.disk_dir, self.version) for e in engines))

    async def send(self, engines: list[EngineClient], bucket: Bucket, weight_version: str) -> None:
        if self.pending is None:
            self.pending = os.path.join(self.disk_dir, f".weight_v{self.version + 1:06d}.tmp-{os.getpid()}")
            os.makedirs(self.pending)
            self.files, self.staged = [], {}
            self.stats = {"bytes": 0.0, "changed": 0.0, "tensors": 0.0, "encode_seconds": 0.0}
        start = time.perf_counter()
        blobs, sums = await asyncio.to_thread(self._encode, bucket)
        if blobs:
            from safetensors.numpy import save

            name = f"part-{len(self.files):05d}.safetensors"
            data = save({n: np.frombuffer(b, np.uint8) for n, b in blobs.items()}, metadata=sums)
            await asyncio.to_thread(wd.write_atomic, os.path.join(self.pending, name), data)
            self.files.append((name, list(blobs)))
            self.stats["bytes"] += len(data)
        self.stats["encode_seconds"] += time.perf_counter() - start

    def _encode(self, bucket: Bucket) -> tuple[dict[str, bytes], dict[str, str]]:
        """Each tensor's delta and checksum, tensors in parallel (numpy's xor, zstd and the hashes
        release the GIL: the diff is memory-bound, one thread leaves bandwidth idle)."""
        from concurrent.futures import ThreadPoolExecutor

        assert self.snapshot is not None
        snapshot = self.snapshot

        def one(item: tuple[str, torch.Tensor]) -> tuple[str, np.ndarray, bytes | None, str]:
            name, tensor = item
            old, kind = snapshot.get(name), self.kinds.get(name)
            if old is None or kind is None or tuple(tensor.shape) != kind[1]:
                where = "is not in" if kind is None else f"has shape {list(kind[1])} in"
                raise wd.DeltaError(
                    f"--update-weight-mode delta: tensor {name} {list(tensor.shape)} {where} "
                    f"--hf-checkpoint {self.hf_checkpoint}; deltas are taken against the checkpoint the "
                    "engines start from, so the trainer must push the checkpoint's tensors"
                )
            # The engines' host checkpoint keeps the checkpoint's dtype: what they load from it (a
            # full disk push is cast the same way when the engine loads it).
            dtype = getattr(torch, wd.SAFETENSORS_DTYPES.get(kind[0], ""), None)
            if dtype is None:
                raise wd.DeltaError(
                    f"--update-weight-mode delta: tensor {name}'s dtype {kind[0]} is not supported"
                )
            new = tensor.detach().to("cpu", dtype).contiguous().view(-1).view(torch.uint8).numpy().copy()
            blob = wd.encode(self.encoding, old, new)
            return name, new, blob, "" if blob is None else wd.checksum(self.checksum, new)

        blobs, sums = {}, {}
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            for name, new, blob, digest in pool.map(one, bucket):
                self.stats["tensors"] += 1
                if blob is not None:
                    blobs[name], sums[name] = blob, digest
                    self.staged[name] = new
                    self.stats["changed"] += 1
        return blobs, sums

    async def finish(self, engines: list[EngineClient], weight_version: str) -> None:
        if self.pending is None:  # an empty push: nothing to publish
            return
        version = self.version + 1
        total = len(self.files)
        weight_map = {}
        for i, (name, tensors) in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            os.replace(os.path.join(self.pending, name), os.path.join(self.pending, final))
            weight_map.update(dict.fromkeys(tensors, final))
        index = {
            "metadata": {
                "version": f"{version:06d}",
                "base_version": f"{version - 1:06d}",
                "delta_encoding": self.encoding,
                "compression_format": "zstd",
                "checksum_format": self.checksum,
            },
            "weight_map": weight_map,
        }
        wd.write_atomic(os.path.join(self.pending, wd.INDEX), json.dumps(index, indent=1).encode())
        os.replace(self.pending, wd.version_dir(self.disk_dir, version))  # published, whole
        self.pending = None
        assert self.snapshot is not None
        self.snapshot.update(self.staged)  # the engines' bytes from now on
        self.staged = {}
        self.version = version
        start = time.perf_counter()
        try:
            await asyncio.gather(*(e.pull_weights(self.local_dir, self.disk_dir, version) for e in engines))
        except BaseException:
            # An engine refused the version (a checksum failed twice, the second time on a fresh
            # copy: the storage corrupted it) and keeps serving the previous one; the push fails,
            # and a push after it starts a fresh stream from --hf-checkpoint.
            self.snapshot, self.version = None, 0
            raise
        self.stats["apply_seconds"] = time.perf_counter() - start
        await asyncio.gather(
            *(e.update_weights_from_disk(self.local_dir, weight_version=weight_version) for e in engines)
        )

    async def abort(self) -> None:
        if self.pending is not None:  # never published: the next push diffs against the same bytes
            shutil.rmtree(self.pending, ignore_errors=True)
        self.pending, self.staged = None, {}

    async def close(self, engines: list[EngineClient]) -> None:
        await self.abort()

    def describe(self) -> dict[str, Any]:
        return {"version": self.version, **self.stats}
