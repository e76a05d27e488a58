"""slime's on-policy distillation recipe, at slime's import path: a teacher server at `--rm-url`
scores each sample as its "reward" (`reward_func`, for --custom-rm-path), and the post-process
function (`post_process_rewards`, for --custom-reward-post-process-path) moves the teacher's
log-probs onto the samples and trains on reward 0 (pure distillation: the signal is the OPD
penalty). The built-in way needs no functions: --opd-teacher-load or --opd-teacher-url
(slime.rollout.teacher), which also keeps the task's own reward.
"""

from __future__ import annotations

from typing import Any

from slime.rollout.teacher import response_log_probs
from slime.utils.sample import Sample


async def reward_func(args: Any, sample: Sample, **kwargs: Any) -> dict[str, Any]:
    """The teacher's answer for the sample's prompt + response, no generation, at the rollout
    temperature (the sample's "reward", as in slime). The response's log-probs are also set on
    the sample, so the post-process function is optional here."""
    from slime.utils.http_utils import post

    if not getattr(args, "rm_url", None):
        raise ValueError(f"{__name__}.reward_func posts to the teacher at --rm-url; give it")
    payload = {
        "input_ids": list(sample.tokens),
        "sampling_params": {
            "temperature": args.rollout_temperature,
            "max_new_tokens": 0,
            "skip_special_tokens": False,
        },
        "return_logprob": True,
        "logprob_start_len": 0,
    }
    answer = await post(args.rm_url, payload)
    sample.teacher_log_probs = response_log_probs(answer, sample, f"the teacher at --rm-url {args.rm_url}")
    return answer


def post_process_rewards(args: Any, samples: list[Sample], **kwargs: Any) -> tuple[list[float], list[float]]:
    """Each sample's teacher log-probs from its answer; rewards 0.0 (slime's: add a task reward
    in your own copy of this function, or use the built-in teacher, which keeps it)."""
    for sample in samples:
        if isinstance(sample.reward, dict) and "meta_info" in sample.reward:
            sample.teacher_log_probs = response_log_probs(sample.reward, sample, "the teacher's answer")
    zeros = [0.0] * len(samples)
    return zeros, list(zeros)
