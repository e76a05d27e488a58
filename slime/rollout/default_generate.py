"""The default generate function: one sample through the engine client, with log-probs. Each
engine call is the sample's `sglang_generate` span (slime.observability.trace_utils), ending with
the answer's meta_info (token counts, latency, queue time, decode throughput)."""

from __future__ import annotations

from typing import Any

from slime.engines.client import EngineClient
from slime.observability.trace_utils import build_sglang_meta_trace_attrs, trace_span
from slime.utils.sample import Sample, Status


def apply_response(sample: Sample, prompt_ids: list[int], output: dict[str, Any], args: Any = None) -> Sample:
    """Fill a fresh sample from one /generate answer (output ids include the stop token): the
    response tokens are exactly the ids the engine generated. `args`: the job's flags (the
    shape of routed experts, when the engine reports them)."""
    meta = output.get("meta_info", {})
    output_ids = list(output.get("output_ids", []))
    logprobs = meta.get("output_token_logprobs")
    sample.tokens = list(prompt_ids)
    sample.response, sample.response_length, sample.loss_mask, sample.rollout_log_probs = "", 0, [], []
    sample.weight_version_spans = []
    sample.append_response_tokens(
        args,
        tokens=output_ids,
        log_probs=[float(item[0]) for item in logprobs] if logprobs is not None else [0.0] * len(output_ids),
        meta_info=meta,
        text=output.get("text", ""),
    )
    if logprobs is None:
        sample.rollout_log_probs = None
    if str((meta.get("finish_reason") or {}).get("type")) not in ("stop", "length", "abort"):
        sample.status = Status.FAILED
    return sample


def _routed(args: Any) -> bool:
    """--use-rollout-routing-replay: ask the engine for each token's experts (SGLang's field)."""
    return bool(getattr(args, "use_rollout_routing_replay", False))


def lora_path(args: Any) -> str | None:
    """--lora-push adapter: the policy's adapter, by its name in the engines (SGLang's field)."""
    from slime.config.lora import ADAPTER_NAME

    return (
        ADAPTER_NAME
        if getattr(args, "lora_push", None) == "adapter" and getattr(args, "lora_rank", 0)
        else None
    )


async def _call_engine(
    client: EngineClient,
    sample: Sample,
    input_ids: list[int],
    params: dict[str, Any],
    args: Any,
    image_data: list[str] | None,
) -> Any:
    """One /generate for `sample`, traced as slime traces it."""
    with trace_span(
        sample, "sglang_generate", attrs={"max_new_tokens": params.get("max_new_tokens")}
    ) as span:
        output = await client.generate(
            input_ids=input_ids,
            sampling_params=params,
            return_logprob=True,
            return_routed_experts=_routed(args),
            lora_path=lora_path(args),
            image_data=image_data,
        )
        span.update(build_sglang_meta_trace_attrs(output.get("meta_info") or {}))
    return output


async def generate(
    client: EngineClient,
    sample: Sample,
    prompt_ids: list[int],
    sampling_params: dict[str, Any],
    args: Any = None,
    image_data: list[str] | None = None,
) -> Sample:
    """Generate one response for `sample` with the engine's log-probs. `image_data`: the prompt's
    images (SGLang's field), with `prompt_ids` holding each image's tokens."""
    output = await _call_engine(client, sample, prompt_ids, sampling_params, args, image_data)
    if image_data:
        check_prompt_tokens(client, sample, len(prompt_ids), output)
    return apply_response(sample, prompt_ids, output, args)


def check_prompt_tokens(client: EngineClient, sample: Sample, sent: int, output: dict[str, Any]) -> None:
    """A request with images: the engine ran as many prompt tokens as were sent (an engine that
    expanded the images its own way would have run another prompt than the trainer will see)."""
    ran = (output.get("meta_info") or {}).get("prompt_tokens")
    if ran is not None and int(ran) != sent:
        raise ValueError(
            f"sample {sample.index}: the engine at {client.base_url} ran {ran} prompt tokens for the "
            f"{sent} sent with its images: it expanded the image placeholders another way than the "
            "checkpoint's processor did (the trainer would see other ids)"
        )


async def continue_sample(
    client: EngineClient,
    sample: Sample,
    sampling_params: dict[str, Any],
    args: Any = None,
    image_data: list[str] | None = None,
) -> Sample:
    """Go on with an aborted sample (--partial-rollout): its prompt and response so far are the
    input, the rest of its max_new_tokens the budget; the new tokens are appended with their
    log-probs and weight versions."""
    params = dict(sampling_params)
    params["max_new_tokens"] = int(params["max_new_tokens"]) - sample.response_length
    if params["max_new_tokens"] <= 0:
        sample.status = Status.TRUNCATED
        return sample
    # Still ABORTED if the request fails: a retry on another engine continues it again.
    output = await _call_engine(client, sample, list(sample.tokens), params, args, image_data)
    if image_data:
        check_prompt_tokens(client, sample, len(sample.tokens), output)
    sample.status = Status.PENDING
    meta = output.get("meta_info", {})
    ids = list(output.get("output_ids", []))
    logprobs = meta.get("output_token_logprobs")
    if logprobs is None and sample.rollout_log_probs is not None:
        raise ValueError(f"the engine at {client.base_url} returned no log-probs for a continued sample")
    sample.append_response_tokens(
        args,
        tokens=ids,
        log_probs=[float(item[0]) for item in logprobs] if logprobs is not None else None,
        meta_info=meta,
        text=output.get("text", ""),
    )
    if str((meta.get("finish_reason") or {}).get("type")) not in ("stop", "length", "abort"):
        sample.status = Status.FAILED
    return sample
