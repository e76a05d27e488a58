"""A rollout function that runs its own asynchronous loop.

    --rollout-function-path slime_plugins.examples.rollout_fn.generate_rollout

Training: it draws prompt groups from the data source, starts them all on slime's shared
`GenerateState` (its semaphore bounds the requests in flight, its sampling parameters are the
rollout flags'), keeps the first `--rollout-batch-size` groups that finish, aborts the rest, and
returns `RolloutFnTrainOutput` with a metric of its own, `rollout/example/kept_share`.
Evaluation: it hands over to slime's default rollout (`sglang_rollout.generate_rollout`).

It runs its coroutines with `slime.utils.async_utils.run`, on the one event loop slime keeps for
the process, so the state it shares between rollouts stays usable.
"""

from __future__ import annotations

import asyncio
from typing import Any

from slime.rollout.base_types import RolloutFnTrainOutput
from slime.rollout.sglang_rollout import (
    GenerateState,
    abort,
    generate_and_rm_group,
)
from slime.rollout.sglang_rollout import (
    generate_rollout as default,
)
from slime.utils.async_utils import run
from slime.utils.types import Sample

EXTRA_GROUPS = 2  # groups started beyond what the rollout needs (the slowest are aborted)


async def _collect(args: Any, rollout_id: int, data_source: Any) -> RolloutFnTrainOutput:
    state = GenerateState(args)
    state.reset()
    wanted = args.rollout_batch_size
    groups = data_source.get_samples(wanted + EXTRA_GROUPS)
    tasks = [
        asyncio.ensure_future(generate_and_rm_group(args, g, dict(state.sampling_params))) for g in groups
    ]
    state.pendings = set(tasks)
    kept: list[list[Sample]] = []
    for next_done in asyncio.as_completed(tasks):
        group = await next_done
        if len(kept) < wanted and not any(s.status == Sample.Status.ABORTED for s in group):
            kept.append(group)
        if len(kept) == wanted:
            break
    state.pendings = {t for t in tasks if not t.done()}
    await abort(args, rollout_id)  # the groups still running: aborted and waited for
    state.reset()
    return RolloutFnTrainOutput(samples=kept, metrics={"rollout/example/kept_share": len(kept) / len(groups)})


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    if evaluation:
        return default(args, rollout_id, data_source, evaluation=True)
    return run(_collect(args, rollout_id, data_source))
