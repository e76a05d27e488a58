"""`disk` transport: a safetensors directory the engines load with /update_weights_from_disk.

Buckets are written as numbered safetensors files into a fresh directory; after the last one
every engine loads the whole directory (config and tokenizer files are copied from the
checkpoint so the directory is a complete Hugging Face model). The directory of the previous
push is removed once the engines have loaded the new one.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile

from slime.bridge.base import Bucket
from slime.engines.client import EngineClient
from slime.utils.weight_delta import copy_model_files


class DiskTransport:
    name = "disk"
    session = False

    def __init__(self, hf_checkpoint: str, root: str | None = None, keep_files: bool = False):
        """`root`: --update-weight-disk-dir (default: the system's temporary directory);
        `keep_files`: --update-weight-disk-keep-files, no directory is removed."""
        self.hf_checkpoint = hf_checkpoint
        self.root = root
        self.keep_files = keep_files
        if root is not None:
            os.makedirs(root, exist_ok=True)
        self.current: str | None = None
        self.pending: str | None = None
        self.count = 0

    async def setup(self, engines: list[EngineClient]) -> None:
        return None

    def _new_dir(self) -> str:
        path = tempfile.mkdtemp(prefix="slime-weights-", dir=self.root)
        copy_model_files(self.hf_checkpoint, path)
        return path

    async def send(self, engines: list[EngineClient], bucket: Bucket, weight_version: str) -> None:
        from safetensors.torch import save_file

        if self.pending is None:
            self.pending = self._new_dir()
            self.count = 0
        self.count += 1
        tensors = {n: t.detach().contiguous().cpu() for n, t in bucket}
        path = os.path.join(self.pending, f"bucket-{self.count:05d}.safetensors")
        await asyncio.to_thread(save_file, tensors, path, {"format": "pt"})

    async def finish(self, engines: list[EngineClient], weight_version: str) -> None:
        if self.pending is None:
            return
        path, self.pending = self.pending, None
        await asyncio.gather(
            *(e.update_weights_from_disk(path, weight_version=weight_version) for e in engines)
        )
        if self.current is not None and not self.keep_files:
            shutil.rmtree(self.current, ignore_errors=True)
        self.current = path

    async def abort(self) -> None:
        return None  # every send completed before it returned

    async def close(self, engines: list[EngineClient]) -> None:
        for path in (self.current, self.pending):
            if path is not None and not (self.keep_files and path == self.current):
                shutil.rmtree(path, ignore_errors=True)
        self.current = self.pending = None
