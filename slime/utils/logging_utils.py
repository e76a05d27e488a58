"""Logging set-up with a per-process prefix (component and rank), never bare print in library code."""

from __future__ import annotations

import logging
import os
import sys


def configure_logging(prefix: str, level: str | int | None = None) -> None:
    """Configure the root logger once per process with a `[prefix]` tag on every line.

    Args:
        prefix: short tag naming the process, e.g. "engine:8123" or "train rank 1".
        level: logging level; defaults to $SLIME_LOG_LEVEL or INFO.
    """
    level = level or os.environ.get("SLIME_LOG_LEVEL", "INFO")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s [{prefix}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
