"""Hand named tensors to another process on the same host through shared memory, by handle.

The sender packs a bucket of tensors into one shared-memory file (under /dev/shm, name chosen by
the OS) and sends only a small JSON handle: the file path, its size, and each tensor's name,
dtype, shape and byte offset. The receiver maps the file and reads tensor views in place, so
no tensor bytes travel through HTTP or pickle. The sender owns the file: it may reuse it for the
next bucket once the receiver has answered, and must `close()` it at the end.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

import torch

_ALIGN = 64
HANDLE_KIND = "slime_shm_v1"


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def dtype_from_str(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16; ValueError for anything else."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use a torch dtype name such as 'float32' or 'bfloat16'")
    return dtype


def dtype_to_str(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class SharedBuffer:
    """A reusable shared-memory file owned by the sender."""

    path: str
    nbytes: int
    data: torch.Tensor  # uint8 view of the whole file

    @classmethod
    def create(cls, nbytes: int) -> SharedBuffer:
        """A new shared-memory file of `nbytes`, its pages reserved up front.

        Raises OSError(ENOSPC) naming the size and the directory when the space is not there;
        the file is removed on any failure.
        """
        directory = shm_dir()
        fd, path = tempfile.mkstemp(prefix="slime_weights_", dir=directory)
        try:
            try:
                _reserve(fd, nbytes, directory)
            finally:
                os.close(fd)
            data = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        return cls(path, nbytes, data)

    def close(self) -> None:
        self.data = torch.empty(0, dtype=torch.uint8)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def _reserve(fd: int, nbytes: int, directory: str) -> None:
    """Allocate the file's pages now. A sparse file (ftruncate) on a full /dev/shm would be
    accepted here and kill the process with SIGBUS at the first write to a missing page."""
    if not hasattr(os, "posix_fallocate"):  # macOS: no shared-memory tmpfs to fill up
        os.ftruncate(fd, nbytes)
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OSError(
                errno.ENOSPC,
                f"cannot reserve {nbytes} bytes ({nbytes / 2**30:.2f} GiB) of shared memory in "
                f"{directory}: no space left; free space there or enlarge it "
                "(e.g. docker run --shm-size)",
            ) from e
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        os.ftruncate(fd, nbytes)  # a filesystem without fallocate: fall back to a sparse file


def packed_size(tensors: list[torch.Tensor]) -> int:
    total = 0
    for t in tensors:
        total = _aligned(total) + t.numel() * t.element_size()
    return max(total, 1)


def _aligned(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


def pack_named_tensors(
    named: list[tuple[str, torch.Tensor]], buffer: SharedBuffer | None = None
) -> tuple[str, SharedBuffer]:
    """Copy tensors into `buffer` (created or grown as needed); return (JSON handle, buffer)."""
    need = packed_size([t for _, t in named])
    if buffer is None or buffer.nbytes < need:
        if buffer is not None:
            buffer.close()
        buffer = SharedBuffer.create(need)
    entries: list[dict[str, Any]] = []
    offset = 0
    for name, tensor in named:
        offset = _aligned(offset)
        src = tensor.detach().to("cpu").contiguous()
        nbytes = src.numel() * src.element_size()
        if nbytes:
            buffer.data[offset : offset + nbytes].view(src.dtype).view(src.shape).copy_(src)
        entries.append(
            {"name": name, "dtype": dtype_to_str(src.dtype), "shape": list(src.shape), "offset": offset}
        )
        offset += nbytes
    handle = {"kind": HANDLE_KIND, "path": buffer.path, "nbytes": buffer.nbytes, "tensors": entries}
    return json.dumps(handle), buffer


def parse_handle(serialized: str) -> dict[str, Any]:
    """Validate a handle's structure; raise ValueError naming the bad field."""
    try:
        handle = json.loads(serialized)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"serialized_named_tensors entry is not a slime shared-memory handle: {e}") from None
    if not isinstance(handle, dict) or handle.get("kind") != HANDLE_KIND:
        raise ValueError(f"serialized_named_tensors entry must be a JSON handle with kind={HANDLE_KIND!r}")
    if not isinstance(handle.get("path"), str) or not isinstance(handle.get("nbytes"), int):
        raise ValueError("shared-memory handle needs 'path' (string) and 'nbytes' (integer)")
    tensors = handle.get("tensors")
    if not isinstance(tensors, list):
        raise ValueError("shared-memory handle needs a 'tensors' list")
    for t in tensors:
        if not (
            isinstance(t, dict)
            and isinstance(t.get("name"), str)
            and isinstance(t.get("dtype"), str)
            and isinstance(t.get("shape"), list)
            and isinstance(t.get("offset"), int)
        ):
            raise ValueError(f"bad tensor entry in shared-memory handle: {t!r}")
    return handle


class MappedFiles:
    """The receiver's mappings of the sender's shared-memory files, kept between requests.

    The sender reuses its files for every bucket and push; mapping a file anew each time would
    fault in every page again (several times slower than copying from touched memory). A
    mapping is dropped when its file is gone or replaced (another inode), and past `max_files`.
    """

    def __init__(self, max_files: int = 4):
        self.max_files = max_files
        self._maps: dict[str, tuple[int, int, torch.Tensor]] = {}  # path -> (inode, nbytes, data)

    def get(self, path: str, nbytes: int) -> torch.Tensor:
        for other in [p for p in self._maps if p != path and not os.path.exists(p)]:
            del self._maps[other]  # the sender closed it: let its memory go
        inode = os.stat(path).st_ino
        cached = self._maps.pop(path, None)
        if cached is not None and cached[0] == inode and cached[1] >= nbytes:
            self._maps[path] = cached  # most recently used last
            return cached[2]
        data = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        self._maps[path] = (inode, nbytes, data)
        while len(self._maps) > self.max_files:
            del self._maps[next(iter(self._maps))]
        return data

    def clear(self) -> None:
        self._maps.clear()


def open_named_tensors(
    handle: dict[str, Any], mapped: MappedFiles | None = None
) -> list[tuple[str, torch.Tensor]]:
    """Map the handle's file (or reuse `mapped`'s mapping of it) and return zero-copy tensor
    views (valid while the sender keeps the file)."""
    path, nbytes = handle["path"], handle["nbytes"]
    if not os.path.isfile(path):
        raise ValueError(f"shared-memory file {path!r} does not exist (did the sender close it?)")
    if os.path.getsize(path) < nbytes:
        raise ValueError(f"shared-memory file {path!r} is smaller than the handle's nbytes={nbytes}")
    if mapped is not None:
        data = mapped.get(path, nbytes)[:nbytes]
    else:
        data = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    out = []
    for t in handle["tensors"]:
        dtype = dtype_from_str(t["dtype"])
        shape = torch.Size(t["shape"])
        size = shape.numel() * torch.empty((), dtype=dtype).element_size()
        if t["offset"] < 0 or t["offset"] + size > nbytes:
            raise ValueError(f"tensor {t['name']!r} lies outside the shared-memory file")
        out.append((t["name"], data[t["offset"] : t["offset"] + size].view(dtype).view(shape)))
    return out
