"""Reward functions: built-in verifiers (`--rm-type`) and user functions (`--custom-rm-path`).

The built-in types are slime's (`slime.rollout.rm_hub`: deepscaler, dapo, math, f1, gpqa,
random, remote_rm, boxed_<type>) plus our `exact`. A sample's `metadata["rm_type"]` overrides
the configured type, as in slime.

A user function has slime's signature: `f(args, sample) -> float | dict` (sync or async), or
with `--group-rm`, `f(args, samples) -> list` (one reward per sample of a prompt group). `args`
is the parsed command line (an argparse.Namespace), as in slime. A reward function that raises
ends the job: the error propagates with its traceback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from slime.observability.trace_utils import trace_span
from slime.rollout.rm_hub import RemoteRMConfig, check_rm_type, is_remote, score_samples
from slime.utils.async_utils import call_maybe_async
from slime.utils.errors import UsageError
from slime.utils.job_trace import RECORDER
from slime.utils.misc import load_function
from slime.utils.sample import Sample


class RewardModel:
    """Scores samples with a built-in verifier or a user function.

    Built at start-up to check the inputs: an unknown `--rm-type`, remote_rm without `--rm-url`
    or a missing optional package fails here, before any generation.
    """

    def __init__(self, rm_type: str | None, custom_rm_path: str | None, group_rm: bool, args: Any):
        self.args = args
        self.group = group_rm
        self.rm_type = rm_type
        self.fn: Callable[..., Any] | None = None
        # --rm-url is read only for remote_rm: checked here when --rm-type is remote_rm, else
        # when a sample's metadata["rm_type"] asks for it. `args` is None where tests score
        # with a built-in type, hence the default.
        self.rm_url: str | None = getattr(args, "rm_url", None)
        # The reward server's settings (retries, backoff, timeout) for --rm-type remote_rm.
        self.remote: RemoteRMConfig | None = None
        if custom_rm_path:
            self.fn = load_function(custom_rm_path, "--custom-rm-path")
            return
        if not rm_type:
            raise UsageError("choose a reward: --rm-type TYPE or --custom-rm-path package.module.function")
        if group_rm:
            raise UsageError(
                "--group-rm needs --custom-rm-path (built-in --rm-type rewards score one sample)"
            )
        check_rm_type(rm_type, self.rm_url)
        if is_remote(rm_type):
            self.remote = RemoteRMConfig(url=self.rm_url or "")

    async def score_group(self, samples: list[Sample]) -> None:
        """Set `reward` on every sample of one prompt group. A sample with its own
        `custom_rm_path` (slime's per-sample field) is scored by that function."""
        own = [s for s in samples if s.custom_rm_path] if not self.group else []
        if own:
            fns = [load_function(str(s.custom_rm_path), f"sample {s.index} custom_rm_path") for s in own]
            results = await asyncio.gather(*(call_maybe_async(f, self.args, s) for f, s in zip(fns, own)))
            for s, r in zip(own, results):
                s.reward = r
            samples = [s for s in samples if not s.custom_rm_path]
            if not samples:
                return
        if self.fn is None:
            rewards = await score_samples(samples, self.rm_type, self.remote, rm_url=self.rm_url)
            for s, r in zip(samples, rewards):
                s.reward = r
            return
        if self.group:
            rewards = await call_maybe_async(self.fn, self.args, samples)
            if not isinstance(rewards, list | tuple) or len(rewards) != len(samples):
                raise ValueError(
                    f"--custom-rm-path with --group-rm must return one reward per sample "
                    f"({len(samples)}), got {type(rewards).__name__}"
                )
            for s, r in zip(samples, rewards):
                s.reward = r
            return
        results = await asyncio.gather(*(call_maybe_async(self.fn, self.args, s) for s in samples))
        for s, r in zip(samples, results):
            s.reward = r


async def score_unscored(reward: RewardModel | None, group: list[Sample], flag: str) -> None:
    """Score one prompt group as slime does: a sample a custom function (`flag`) already gave a
    reward keeps it; a group reward (--group-rm) scores the whole group."""
    todo = group if reward is not None and reward.group else [s for s in group if s.reward is None]
    if not todo:
        return
    if reward is None:
        raise ValueError(
            f"{flag} returned samples without a reward and no --rm-type/--custom-rm-path is set to score them"
        )
    name = "group_reward_model" if reward.group else "reward_model"
    with trace_span(todo, name), RECORDER.lane("reward") as row, RECORDER.span(name, row, samples=len(todo)):
        await reward.score_group(todo)  # a span of the job's timeline too (--trace-dir)
