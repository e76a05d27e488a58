"""Rows of the .jsonl / .parquet files a job reads (prompts, evaluation sets, logged metrics),
each with where it came from (file:line), and one clear error naming the flag and the row."""

from __future__ import annotations

import json
import os
from typing import Any

from slime.utils.errors import UsageError


class DataError(UsageError):
    """Bad prompt data: names the file (and line) and the flag to fix."""


def read_rows(path: str, flag: str = "--prompt-data") -> list[tuple[str, dict[str, Any]]]:
    """(location, row) pairs from a .jsonl/.json-lines or .parquet file; location is file:line."""
    if not os.path.isfile(path):
        raise DataError(f"{flag} {path!r}: no such file")
    if path.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise DataError(f"{flag} {path!r}: reading parquet needs pyarrow (pip install pyarrow)") from e
        table = pq.read_table(path)
        return [(f"{path}:row {i + 1}", row) for i, row in enumerate(table.to_pylist())]
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
            rows.append((f"{path}:{lineno}", row))
    if not rows:
        raise DataError(f"{flag} {path!r} holds no rows")
    return rows
