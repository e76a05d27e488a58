"""Running coroutines from synchronous code: the one module for it.

`run(coro)`, as slime's plugins and the rollout manager call it: coroutines run on one event
loop that lives in a background thread for the whole process, so what a plugin keeps between
calls (an aiohttp session, a semaphore) stays bound to a loop that is still running.

`run_sync(coro)`, for the train side and the driver: the coroutine runs in the calling thread
(a fresh loop per call; a helper thread only where the calling thread already runs a loop). It
stays apart from `run` on purpose: the weight push iterates the trainer's export inside its
coroutine, and that export runs collectives and CUDA kernels that must see the calling thread's
state (its current CUDA device, set per rank) and must not hold up the shared loop meanwhile.

`call_maybe_async(fn, ...)`: a user function that may be sync or async, awaited when it is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["call_maybe_async", "get_async_loop", "run", "run_sync"]

T = TypeVar("T")


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="slime-async-utils", daemon=True)
        self.thread.start()

    def run(self, aw: Awaitable[T]) -> T:
        if threading.current_thread() is self.thread:
            raise RuntimeError(
                "slime.utils.async_utils.run was called from a coroutine on its own loop: await it"
            )
        coro = aw if asyncio.iscoroutine(aw) else _await(aw)
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()


async def _await(aw: Awaitable[T]) -> T:
    return await aw


_loop: _LoopThread | None = None
_guard = threading.Lock()


def get_async_loop() -> _LoopThread:
    """The process's background loop (started on first use); `.loop` is the asyncio loop."""
    global _loop
    with _guard:
        if _loop is None:
            _loop = _LoopThread()
        return _loop


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(coro) in the calling thread, or the same in a helper thread when this thread
    already runs a loop (Ray runs actor methods on threads that may have one)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


def run(coro: Awaitable[T]) -> T:
    """Run `coro` (any awaitable) on the background loop and wait for its result (its exception is raised
    here)."""
    return get_async_loop().run(coro)


async def call_maybe_async(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)`, awaited when it returns an awaitable (user functions may be either)."""
    result = fn(*args, **kwargs)
    if inspect.isawaitable(result):
        result = await result
    return result
