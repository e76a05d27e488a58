"""slime.tinker's bookkeeping of long runs, on the event loop alone: a future's result stays for a
while after its first fetch (a retry gets it again), then goes, and one not fetched yet stays;
a model's queue gives up on a seq_id that never comes."""

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


def test_a_seq_id_never_sent_is_given_up_on_after_the_gap_time():
    """A client that took a seq_id and never sent it (its connection gone) would hold every later
    request of the model: after GAP_S they run, and the late one is refused as out of order."""
    from slime.tinker.errors import TinkerUserError
    from slime.tinker.order import GAP_S, SeqQueue

    async def run() -> list[int]:
        ran: list[int] = []
        done = asyncio.Event()

        def job(seq: int):
            async def work() -> None:
                ran.append(seq)
                if seq == 4:
                    done.set()

            return work

        ready = asyncio.get_running_loop().create_future()
        ready.set_result(None)
        queue = SeqQueue(ready)
        queue.put(1, job(1))
        for seq in (3, 4):  # seq_id 2 never comes
            queue.admit(seq)
            queue.put(seq, job(seq))
        await asyncio.sleep(0)  # (the drain runs what it can: 1)
        start = time.monotonic()
        assert queue.skip_gap(start) == [] and queue.skip_gap(start + GAP_S) == []
        assert queue.skip_gap(start + GAP_S + 1) == [2]
        await done.wait()
        with pytest.raises(TinkerUserError, match="seq_id 2 is out of order"):
            queue.admit(2)
        return ran

    assert asyncio.run(run()) == [1, 3, 4]
