"""The OpenAI `/v1/completions` subset on top of the engine's SGLang-style requests and results."""

from __future__ import annotations

import time
import uuid
from typing import Any

from slime.engines.protocol import CompletionRequest, GenerateRequest
from slime.engines.torch_engine.engine import TorchEngine
from slime.utils.sampling_params import SamplingParams


def completion_requests(body: CompletionRequest) -> list[GenerateRequest]:
    """One request per prompt and choice; choice c of a seeded request samples with seed + c."""
    requests = []
    for p_index, prompt in enumerate(body.prompts):
        for c in range(body.n):
            params = SamplingParams(
                max_new_tokens=body.max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                stop=body.stop,
                sampling_seed=None if body.seed is None else body.seed + c,
            )
            requests.append(
                GenerateRequest(
                    rid=f"cmpl-{uuid.uuid4().hex}-{p_index}-{c}",
                    input_ids=tuple(prompt) if isinstance(prompt, list) else None,
                    text=prompt if isinstance(prompt, str) else None,
                    sampling_params=params,
                    return_logprob=body.logprobs is not None,
                    top_logprobs_num=body.logprobs or 0,
                )
            )
    return requests


def completion_response(
    engine: TorchEngine, body: CompletionRequest, results: list[dict[str, Any]]
) -> dict[str, Any]:
    """The OpenAI response body; `results` holds n consecutive choices per prompt.

    Decodes every output token on its own, under the engine's tokenizer lock: call it from a
    worker thread, not the event loop.
    """
    choices = []
    prompt_tokens = completion_tokens = 0
    for i, res in enumerate(results):
        meta = res["meta_info"]
        # SGLang's adapter reports the finish type as is: "stop", "length" or "abort".
        choice: dict[str, Any] = {
            "index": i,
            "text": res["text"],
            "finish_reason": (meta["finish_reason"] or {}).get("type"),
            "logprobs": None,
        }
        if body.logprobs is not None:
            ids = res["output_ids"]
            tokens = [engine.tokens.decode([t], False) for t in ids]
            choice["logprobs"] = {
                "tokens": tokens,
                "token_logprobs": [lp for lp, _, _ in meta["output_token_logprobs"]],
                "top_logprobs": [
                    {engine.tokens.decode([t], False): lp for lp, t, _ in top}
                    for top in meta.get("output_top_logprobs", [[] for _ in ids])
                ],
                "text_offset": _offsets(tokens),
            }
        choices.append(choice)
        if i % body.n == 0:
            prompt_tokens += meta["prompt_tokens"]
        completion_tokens += meta["completion_tokens"]
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": body.model or engine.config.model_path,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _offsets(tokens: list[str]) -> list[int]:
    out, pos = [], 0
    for t in tokens:
        out.append(pos)
        pos += len(t)
    return out
