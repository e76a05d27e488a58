"""slime's `slime.rollout.forge_load.generate_rollout`: a `--rollout-function-path` that replays
rollout dumps (--load-forge-rollout-data) while the whole job runs as usual: the engines start,
the weights are pushed after every step, colocated memory moves as it would. Unlike
--load-debug-rollout-data (train only, no engines), it exercises the real loop on known data.

The path is a file, or a template with {rollout_id}: rollout N reads TEMPLATE.format(rollout_id=N), falling
back to rollout 0's file when N's is missing (a short dump series replayed over a long run); evaluation reads
eval_N's file (a template is needed; slime skips evaluation without one). Dumps are ours or slime's
(--save-debug-rollout-data, --dump-details)."""

from __future__ import annotations

import os
from typing import Any

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput
from slime.rollout.dump import load_dump
from slime.utils.errors import UsageError
from slime.utils.sample import Sample

FLAG = "--load-forge-rollout-data"


def forge_path(template: str | None, rollout_id: int, evaluation: bool) -> str:
    """The dump to replay for rollout `rollout_id`."""
    if not template:
        raise UsageError(
            f"slime.rollout.forge_load.generate_rollout replays {FLAG}: give the dump path or template"
        )
    if "{rollout_id}" not in template:
        if evaluation:
            raise UsageError(
                f"{FLAG} {template}: evaluation replays eval_<rollout_id> files; give a {{rollout_id}} "
                "template"
            )
        return template
    path = template.format(rollout_id=("eval_" if evaluation else "") + str(rollout_id))
    if evaluation or os.path.isfile(path):
        return path
    return template.format(rollout_id="0")


def generate_rollout(args: Any, rollout_id: int, data_source: Any, evaluation: bool = False) -> Any:
    """The dumped samples of rollout `rollout_id` (slime's signature; `data_source` is not drawn from)."""
    path = forge_path(getattr(args, "load_forge_rollout_data", None), rollout_id, evaluation)
    samples = [Sample.from_dict(s) for s in load_dump(path, FLAG)["samples"]]
    if not evaluation:
        return RolloutFnTrainOutput(samples=samples)
    key = getattr(args, "eval_reward_key", None) or getattr(args, "reward_key", None)
    rewards = [0.0 if s.reward is None else s.scalar_reward(key) for s in samples]
    truncated = [s.status == Sample.Status.TRUNCATED for s in samples]
    return RolloutFnEvalOutput(
        data={"forge_eval": {"rewards": rewards, "truncated": truncated, "samples": samples}}
    )
