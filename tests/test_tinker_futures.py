"""slime.tinker.futures: a result stays for a while after its first fetch (a retry gets it
again), then goes; one not fetched yet stays."""

from __future__ import annotations

import asyncio
import time

import pytest

from slime.tinker.errors import TinkerNotFound
from slime.tinker.futures import Futures, Outcome


def test_a_fetched_result_is_kept_for_retries_then_dropped():
    async def run() -> None:
        futures = Futures(poll_s=0.05, keep_s=60.0)
        fetched, waiting = futures.create("s"), futures.create("s")
        assert await futures.wait(waiting) is None  # not resolved: try again
        futures.resolve(fetched, Outcome(json={"a": 1}))
        futures.resolve(waiting, Outcome(json={"b": 2}))
        first = await futures.wait(fetched)
        assert first is not None and first.json == {"a": 1}
        futures.sweep(time.monotonic() + 30)  # within keep_s: a retry gets it again
        again = await futures.wait(fetched)
        assert again is not None and again.json == {"a": 1}
        futures.sweep(time.monotonic() + 61)
        with pytest.raises(TinkerNotFound, match="fetched more than 60 s ago"):
            await futures.wait(fetched)
        kept = await futures.wait(waiting)  # never fetched before the sweep: still there
        assert kept is not None and kept.json == {"b": 2}

    asyncio.run(run())
