"""The error every bad user input raises: a flag, a file, a function path."""

from __future__ import annotations


class UsageError(ValueError):
    """Bad user input, named with its fix. The job exits 2 with the message alone (no traceback),
    whether it was raised in the driver or inside an actor."""
