"""The default generate function: one sample through the engine client, with log-probs."""

from __future__ import annotations

from typing import Any

from slime.engines.client import EngineClient
from slime.rollout.sample import Sample, Status


def apply_response(sample: Sample, prompt_ids: list[int], output: dict[str, Any]) -> Sample:
    """Fill a sample from one /generate answer (output ids include the stop token)."""
    meta = output.get("meta_info", {})
    output_ids = list(output.get("output_ids", []))
    sample.tokens = list(prompt_ids) + output_ids
    sample.response = output.get("text", "")
    sample.response_length = len(output_ids)
    sample.loss_mask = [1] * len(output_ids)
    logprobs = meta.get("output_token_logprobs")
    sample.rollout_log_probs = [float(item[0]) for item in logprobs] if logprobs is not None else None
    sample.weight_version = (
        str(meta.get("weight_version")) if meta.get("weight_version") is not None else None
    )
    finish = str((meta.get("finish_reason") or {}).get("type"))
    statuses = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
    sample.status = statuses.get(finish, Status.FAILED)
    return sample


async def generate(
    client: EngineClient, sample: Sample, prompt_ids: list[int], sampling_params: dict[str, Any]
) -> Sample:
    """Generate one response for `sample` with the engine's log-probs."""
    output = await client.generate(input_ids=prompt_ids, sampling_params=sampling_params, return_logprob=True)
    return apply_response(sample, prompt_ids, output)
