"""slime's fully asynchronous rollout, at slime's import path.

`--rollout-function-path slime.rollout.fully_async_rollout.generate_rollout_fully_async` selects
the continuous schedule: the same as `--fully-async` (slime.rollout.continuous; docs/async.md).
The flag is turned into the schedule when the arguments are parsed, so this function is never
the rollout function; called directly, it says so.
"""

from __future__ import annotations

from typing import Any

__all__ = ["generate_rollout_fully_async"]


def generate_rollout_fully_async(
    args: Any, rollout_id: int, data_buffer: Any, evaluation: bool = False
) -> Any:
    raise RuntimeError(
        "slime.rollout.fully_async_rollout.generate_rollout_fully_async is the continuous schedule here: "
        "name it with --rollout-function-path (or pass --fully-async) instead of calling it from a "
        "rollout function"
    )
