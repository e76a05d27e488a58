"""slime's built-in dynamic-sampling filters (DAPO's dynamic sampling)."""

from __future__ import annotations

import statistics
from typing import Any

from slime.rollout.filter_hub.base_types import DynamicFilterOutput
from slime.utils.sample import Sample

__all__ = ["check_reward_nonzero_std", "check_reward_nonzero_std_with_fallback"]


def check_reward_nonzero_std(args: Any, samples: list[Sample], **kwargs: Any) -> DynamicFilterOutput:
    """Keep a group whose rewards differ (a group with one reward teaches GRPO nothing); a
    dropped group's reason names that reward, rounded to 0.1: `zero_std_<reward>`."""
    rewards = [s.get_reward_value(args) for s in samples]
    keep = len(rewards) > 1 and statistics.stdev(rewards) > 1e-6
    return DynamicFilterOutput(keep=keep, reason=None if keep else f"zero_std_{round(rewards[0], 1)}")


def check_reward_nonzero_std_with_fallback(
    args: Any, samples: list[Sample], **kwargs: Any
) -> DynamicFilterOutput:
    """The same, but a rejected group is kept when the rollout would otherwise draw more prompts."""
    output = check_reward_nonzero_std(args, samples, **kwargs)
    output.keep_when_insufficient = True
    return output
