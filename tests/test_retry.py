"""slime.utils.retry: the one retry policy of the engine client, the plugin HTTP helpers and the
remote reward model (each is also tested against a real server in its own file)."""

from __future__ import annotations

import asyncio

import pytest

from slime.utils.retry import RetryPolicy, retrying


def test_waits_grow_by_the_multiplier_up_to_the_cap_with_bounded_jitter():
    assert [RetryPolicy(5, 0.5).wait(n) for n in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 4.0]
    assert [RetryPolicy(5, 1.0, multiplier=1.0).wait(n) for n in (1, 2, 3)] == [1.0, 1.0, 1.0]
    assert [RetryPolicy(9, 1.0, max_backoff_s=3.0).wait(n) for n in (1, 2, 3, 4)] == [1.0, 2.0, 3.0, 3.0]
    jittered = [RetryPolicy(9, 1.0, max_backoff_s=3.0, jitter_s=0.5).wait(4) for _ in range(200)]
    assert all(3.0 <= w <= 3.5 for w in jittered) and len(set(jittered)) > 1
    with pytest.raises(ValueError, match="at least 1 attempt"):
        RetryPolicy(0, 1.0)


def _flaky(failures: int, error: Exception):
    calls = []

    async def call():
        calls.append(1)
        if len(calls) <= failures:
            raise error
        return len(calls)

    return call, calls


def test_retries_what_is_retryable_until_it_succeeds_or_the_attempts_run_out():
    told = []
    call, calls = _flaky(2, ConnectionError("refused"))
    policy = RetryPolicy(3, 0.001)
    assert asyncio.run(retrying(call, policy, lambda e: True, lambda n, e, w: told.append((n, str(e))))) == 3
    assert told == [(1, "refused"), (2, "refused")]

    call, calls = _flaky(5, ConnectionError("refused"))
    with pytest.raises(ConnectionError, match="refused"):  # the last failure, unchanged
        asyncio.run(retrying(call, policy, lambda e: True))
    assert len(calls) == 3


def test_a_failure_the_caller_refuses_to_retry_propagates_at_once():
    call, calls = _flaky(5, ValueError("not JSON"))
    with pytest.raises(ValueError, match="not JSON"):
        asyncio.run(retrying(call, RetryPolicy(10, 0.001), lambda e: isinstance(e, ConnectionError)))
    assert len(calls) == 1
