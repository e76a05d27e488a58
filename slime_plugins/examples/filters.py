"""A dynamic-sampling filter that says why it drops a group.

    --dynamic-sampling-filter-path slime_plugins.examples.filters.drop_uniform_groups

A group whose samples all have the same reward teaches GRPO nothing (every advantage is 0).
This filter drops it with a reason, `all_correct`, `all_wrong` or `all_equal`, which the rollout
counts in its metrics as `rollout/dynamic_filter/drop_<reason>`. When too few prompts remain to
fill the rollout, the group is kept anyway (`keep_when_insufficient`).
"""

from __future__ import annotations

from typing import Any

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.types import Sample


def drop_uniform_groups(args: Any, samples: list[Sample]) -> DynamicFilterOutput:
    rewards = {float(s.get_reward_value(args)) for s in samples}
    if len(rewards) > 1:
        return DynamicFilterOutput(keep=True)
    (reward,) = rewards
    reason = "all_correct" if reward >= 1.0 else "all_wrong" if reward <= 0.0 else "all_equal"
    return DynamicFilterOutput(keep=False, reason=reason, keep_when_insufficient=True)
