"""The `remote_rm` reward: POST the sample to an HTTP reward server (`--rm-url`).

The request body is JSON `{"prompt", "response", "label"}`; the reply's JSON is the reward, as
is (a number, or a dict to pick from with `--reward-key`). A failed attempt (connection error,
timeout, HTTP error status, a body that is not JSON) is retried with exponential backoff; after
the last attempt one RemoteRewardError names the URL and the last cause.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from slime.utils.errors import UsageError
from slime.utils.retry import RetryPolicy, retrying

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)


class RemoteRewardError(RuntimeError):
    """The reward server did not give a reward after every attempt."""


@dataclass(frozen=True)
class RemoteRMConfig:
    url: str
    """`--rm-url`: where the samples are POSTed."""
    max_retries: int = 10
    """Attempts in all (the first one included) before giving up."""
    timeout_s: float = 120.0
    """Total time one attempt may take (connect, send, wait for and read the reply)."""
    backoff_s: float = 1.0
    """Wait before the second attempt; it doubles each time, up to `max_backoff_s`, plus up to
    `backoff_s` of random jitter so that many samples do not retry in step."""
    max_backoff_s: float = 30.0
    """The cap on the doubling wait."""

    def __post_init__(self) -> None:
        if not self.url:
            raise UsageError("--rm-type remote_rm needs --rm-url URL (the reward server to POST samples to)")
        if not self.url.startswith(("http://", "https://")):
            raise UsageError(f"--rm-url {self.url!r} must be an http:// or https:// URL")
        if self.max_retries < 1:
            raise ValueError(f"max_retries must be at least 1, got {self.max_retries}")

    @property
    def policy(self) -> RetryPolicy:
        """Doubling waits from `backoff_s`, capped at `max_backoff_s`, plus up to `backoff_s` of jitter."""
        return RetryPolicy(self.max_retries, self.backoff_s, 2.0, self.max_backoff_s, jitter_s=self.backoff_s)


class RemoteRewardClient:
    """Posts samples to the reward server over one HTTP session; use as `async with`."""

    def __init__(self, config: RemoteRMConfig):
        self.config = config
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> RemoteRewardClient:
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.timeout_s))
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def score(self, prompt: Any, response: str, label: Any) -> Any:
        """The server's reward for one sample (retried; RemoteRewardError after the last attempt)."""
        import aiohttp

        if self._session is None:
            raise RuntimeError("RemoteRewardClient.score needs `async with RemoteRewardClient(...)`")
        cfg = self.config
        payload = {"prompt": prompt, "response": response, "label": label}
        session = self._session

        async def once() -> Any:
            async with session.post(cfg.url, json=payload) as reply:
                reply.raise_for_status()
                return await reply.json()

        def retryable(e: BaseException) -> bool:  # connection, timeout, error status, not JSON
            return isinstance(e, (aiohttp.ClientError, asyncio.TimeoutError, ValueError))

        def on_retry(failures: int, e: BaseException, wait: float) -> None:
            logger.info(
                "remote_rm: POST %s failed (%s: %s), retry %d/%d in %.1fs",
                cfg.url,
                type(e).__name__,
                e,
                failures,
                cfg.max_retries - 1,
                wait,
            )

        try:
            return await retrying(once, cfg.policy, retryable, on_retry)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise RemoteRewardError(
                f"remote_rm: POST {cfg.url} failed {cfg.max_retries} times; last error: "
                f"{type(e).__name__}: {e}"
            ) from e
