"""A training model's requests in their `seq_id` order (slime.tinker.service): 1, 2, 3, ...,
whatever order they arrive in (the chunks of one forward_backward arrive concurrently). A request
refused at submission still uses up its seq_id; one that ran or waits already is refused as out
of order; one never sent is given up on after GAP_S."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from slime.tinker.errors import TinkerUserError

GAP_S = 120.0
"""How long a model's queue waits for a seq_id that never arrives (SeqQueue.skip_gap)."""


class SeqQueue:
    """One model's requests in seq_id order (module docstring)."""

    def __init__(self, ready: asyncio.Future[Any]):
        self.ready = ready
        self.next = 1
        self.pending: dict[int, Callable[[], Awaitable[None]] | None] = {}
        self._task: asyncio.Task[None] | None = None
        self._gap: tuple[int, float] | None = None
        """(the seq_id waited for, when requests were first seen waiting on it)."""

    def skip_gap(self, now: float, gap_s: float = GAP_S) -> list[int]:
        """Give up on the seq_ids that requests behind them have waited for longer than `gap_s`
        (a client that took one and never sent it, its connection gone): the waiting requests
        run, and the skipped seq_ids, should they come, are refused as out of order. Returns the
        seq_ids given up on."""
        if not self.pending or self.next in self.pending:
            self._gap = None
            return []
        if self._gap is None or self._gap[0] != self.next:  # a new gap: its own clock
            self._gap = (self.next, now)
        if now - self._gap[1] <= gap_s:
            return []
        skipped = list(range(self.next, min(self.pending)))
        self.next = min(self.pending)
        self._gap = None
        if self._task is None or self._task.done():  # (a drain mid-job goes on from the new next)
            self._task = asyncio.get_running_loop().create_task(self._drain())
        return skipped

    def admit(self, seq_id: int) -> None:
        if not isinstance(seq_id, int) or seq_id < self.next or seq_id in self.pending:
            raise TinkerUserError(
                f"seq_id {seq_id!r} is out of order: this model has taken seq_ids up to {self.next - 1} "
                f"and holds {sorted(self.pending)} waiting (each request's seq_id is the next one)"
            )

    def put(self, seq_id: int, job: Callable[[], Awaitable[None]] | None) -> None:
        """Queue `job` as `seq_id` (None: a refused request, which only uses up its seq_id)."""
        self.pending[seq_id] = job
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        while self.next in self.pending:
            job = self.pending.pop(self.next)
            self.next += 1
            if job is not None:
                await job()
