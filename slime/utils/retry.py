"""The one retry policy of every HTTP call the framework makes: the engine client
(slime.engines.client), the plugin helpers (slime.utils.http_utils) and the remote reward model
(slime.rollout.rm_hub.remote).

A policy says how many attempts in all and how long to wait between them (a first wait that
grows by a factor each time, up to a cap, plus random jitter so that many callers failing at
once do not retry in step). Which failures may be retried is the caller's to say, because it
depends on the call: a GET may be sent again, a /generate that reached the engine must not be.
The caller also turns the last failure into its own error, naming what it called.

Written here rather than taken from tenacity: the three callers need only attempts, a growing
capped wait with jitter and a predicate, about thirty lines, and a new dependency of the CPU
install (which every plugin and test environment carries) is not worth that.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from slime.utils.job_trace import instant

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int
    """Attempts in all, the first one included (1: no retry)."""
    backoff_s: float
    """The wait after the first failed attempt."""
    multiplier: float = 2.0
    """Each later wait is the one before times this (1: a fixed interval)."""
    max_backoff_s: float = math.inf
    """The cap on the growing wait (the jitter comes on top)."""
    jitter_s: float = 0.0
    """Up to this many seconds, drawn uniformly, added to every wait."""

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError(f"a retry policy needs at least 1 attempt, got {self.attempts}")

    def wait(self, failures: int) -> float:
        """Seconds to wait after the `failures`-th failed attempt (1-based)."""
        grown = min(self.backoff_s * self.multiplier ** (failures - 1), self.max_backoff_s)
        return grown + (random.uniform(0, self.jitter_s) if self.jitter_s > 0 else 0.0)


async def retrying(
    call: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    retryable: Callable[[BaseException], bool],
    on_retry: Callable[[int, BaseException, float], None] | None = None,
) -> T:
    """`await call()` until it returns, at most `policy.attempts` times. A failure that
    `retryable` refuses, or the last attempt's, propagates unchanged; before each retry
    `on_retry(failures, error, wait_s)` is told (to log it)."""
    failures = 0
    while True:
        try:
            return await call()
        except Exception as e:
            failures += 1
            if failures >= policy.attempts or not retryable(e):
                raise
            wait = policy.wait(failures)
            instant("retry", "retries", cat="fault", failures=failures, wait_s=wait, error=str(e)[:200])
            if on_retry is not None:
                on_retry(failures, e, wait)
            await asyncio.sleep(wait)
