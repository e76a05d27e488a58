"""The adapters' error: a request refused with a status and a message naming what is wrong."""

from __future__ import annotations


class AdapterError(Exception):
    """A request the adapter refuses: `status` and a message naming what is wrong; `kind` is the
    protocol's error type (invalid_request_error, not_found_error, ...)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
