"""Writing files so that a reader never sees half of one."""

from __future__ import annotations

import os
import tempfile


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to a temporary file beside `path`, fsync it, then rename it over `path`
    (creating the directory if needed)."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_torch_save(obj: object, path: str) -> None:
    """torch.save `obj` to `path + ".partial"`, then rename it over `path` (readers such as
    slime.tools.check_sync_parameter skip `.partial` files)."""
    import torch

    partial = path + ".partial"
    try:
        torch.save(obj, partial)
        os.replace(partial, path)
    except BaseException:
        if os.path.exists(partial):
            os.unlink(partial)
        raise
