"""The futures of Tinker's protocol: a request that does work answers at once with a request id,
and the SDK long-polls `retrieve_future` until the result is there.

A poll waits up to `POLL_S` for the result (the SDK's read timeout is 45 s) and otherwise answers
`try_again`, which the SDK polls again at once. A result is JSON, or protobuf bytes (forward,
forward_backward, sample), or an error with its category ("user": bad input; "server"). A result
stays for `KEEP_S` after it was first fetched (the SDK may fetch it again after a network
error), then goes (`sweep`, every 30 s); all of a session's go when it ends. A long run's results
do not pile up.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from slime.tinker.errors import TinkerNotFound

POLL_S = 20.0
KEEP_S = 300.0
"""How long a result stays after it was first fetched."""


@dataclass
class Outcome:
    json: dict[str, Any] | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "server"


@dataclass
class _Entry:
    session_id: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Outcome | None = None
    fetched: float | None = None
    """When its outcome was first answered (time.monotonic)."""


class Futures:
    """Request id -> its outcome, on the server's event loop."""

    def __init__(self, poll_s: float = POLL_S, keep_s: float = KEEP_S):
        self.poll_s, self.keep_s = poll_s, keep_s
        self._entries: dict[str, _Entry] = {}
        self._ids = itertools.count(1)

    def create(self, session_id: str) -> str:
        request_id = f"req-{next(self._ids)}"
        self._entries[request_id] = _Entry(session_id)
        return request_id

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        entry = self._entries.get(request_id)
        if entry is None:  # its session ended meanwhile
            return
        entry.outcome = outcome
        entry.done.set()

    async def wait(self, request_id: Any) -> Outcome | None:
        """The outcome, or None after the poll time (the SDK then asks again)."""
        entry = self._entries.get(request_id) if isinstance(request_id, str) else None
        if entry is None:
            raise TinkerNotFound(
                f"unknown request_id {request_id!r} (never issued, its session ended, or its result was "
                f"fetched more than {self.keep_s:g} s ago)"
            )
        try:
            await asyncio.wait_for(entry.done.wait(), self.poll_s)
        except TimeoutError:
            return None
        if entry.fetched is None:
            entry.fetched = time.monotonic()
        return entry.outcome

    def sweep(self, now: float | None = None) -> None:
        """Drop the results first fetched more than keep_s ago."""
        now = time.monotonic() if now is None else now
        stale = [
            r for r, e in self._entries.items() if e.fetched is not None and now - e.fetched > self.keep_s
        ]
        for request_id in stale:
            del self._entries[request_id]

    def drop_session(self, session_id: str) -> None:
        for request_id in [r for r, e in self._entries.items() if e.session_id == session_id]:
            del self._entries[request_id]
