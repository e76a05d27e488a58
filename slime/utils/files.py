"""Writing files so that a reader never sees half of one, and naming one file per rollout."""

from __future__ import annotations

import os
import shutil
import string
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO


def atomic_write_text(path: str, text: str) -> None:
    """Write `text` to a temporary file beside `path`, fsync it, then rename it over `path`
    (creating the directory if needed)."""
    with atomic_text_file(path) as f:
        f.write(text)


@contextmanager
def atomic_text_file(path: str) -> Iterator[TextIO]:
    """A text file to write in pieces that appears at `path` whole (fsynced, renamed into place)
    when the block ends, and not at all if it fails."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "w") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_torch_save(obj: object, path: str) -> None:
    """torch.save `obj` into a temporary file beside `path` (creating the directory if needed),
    renamed over `path` when complete; the temporary file is removed on failure."""
    import torch  # here, not at the top: the driver checks dump paths without loading torch

    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


@contextmanager
def staged_directory(out: str) -> Iterator[str]:
    """A new directory beside `out` to write into; when the body completes it replaces `out`
    (renamed into place), and when it fails it is removed: a reader never sees half of one."""
    final = os.path.abspath(out)
    os.makedirs(os.path.dirname(final), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.", dir=os.path.dirname(final))
    try:
        yield staging
        old = None
        if os.path.exists(final):  # aside first: a crash now leaves it there, not deleted
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.old.", dir=os.path.dirname(final))
            os.replace(final, os.path.join(old, "was"))
        os.replace(staging, final)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def template_problem(template: str, flag: str, fields: tuple[str, ...] = ("rollout_id",)) -> str | None:
    """One line saying why `template` cannot name one file per rollout (and rank), or None."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as e:
        return f"{flag} {template!r} is not a valid template ({e})"
    missing = [f for f in fields if f not in names]
    if missing:
        need = " and ".join("{" + f + "}" for f in missing)
        return f"{flag} {template!r} must contain {need}, or every rollout would overwrite the same file"
    unknown = sorted(names - set(fields))
    if unknown:
        return f"{flag} {template!r} has unknown fields {unknown}; it may use {list(fields)}"
    return None
