"""SGLang's /generate response for a finished sequence of the torch engine."""

from __future__ import annotations

import base64
import time
from typing import Any

import torch

from slime.engines.torch_engine.sequence import RequestTimes, Sequence


def result_of(engine: Any, seq: Sequence) -> dict[str, Any]:
    """SGLang's /generate response object for one finished sequence of `engine` (a TorchEngine);
    stamps `seq.times.responded`, where its `e2e_latency` ends."""
    text = engine.tokens.decode(seq.output_ids, seq.params.skip_special_tokens)
    if seq.stop_text_end is not None:
        text = text[: seq.stop_text_end]
    meta: dict[str, Any] = {
        "id": seq.rid,
        "finish_reason": seq.finish_reason.to_json() if seq.finish_reason else None,
        "prompt_tokens": seq.num_prompt_tokens,
        "completion_tokens": len(seq.output_ids),
        "cached_tokens": 0,
        "weight_version": seq.weight_version,
        # Ours (SGLang reports only the version at the end): the weights of every token.
        "weight_version_spans": [list(span) for span in seq.version_spans],
    }
    if seq.return_logprob:
        texts = engine.tokens.token_texts if seq.return_text_in_logprobs else (lambda ids: [None] * len(ids))
        meta["output_token_logprobs"] = [
            [lp, t, text] for lp, t, text in zip(seq.output_logprobs, seq.output_ids, texts(seq.output_ids))
        ]
        if seq.input_logprobs is not None:
            ids = seq.prompt_ids[seq.logprob_start_len :]
            meta["input_token_logprobs"] = [
                [lp, t, text] for lp, t, text in zip(seq.input_logprobs, ids, texts(ids))
            ]
        if seq.top_logprobs_num:
            meta["output_top_logprobs"] = [
                [[lp, t, None] for lp, t in top] for top in seq.output_top_logprobs
            ]
    if seq.return_routed_experts:
        # SGLang's encoding: int32 [tokens fed to the model (all but the last), layers, top-k],
        # flattened and base64-encoded.
        routed = torch.cat(seq.routed_experts)[: seq.num_tokens - 1] if seq.routed_experts else torch.zeros(0)
        routed = routed.to(torch.int32).contiguous()
        meta["routed_experts"] = base64.b64encode(routed.numpy().tobytes()).decode("ascii")
    seq.times.responded = time.perf_counter()
    meta.update(timing_meta_info(seq.times, len(seq.output_ids)))
    return {"text": text, "output_ids": list(seq.output_ids), "meta_info": meta}


def timing_meta_info(times: RequestTimes, completion_tokens: int) -> dict[str, float]:
    """SGLang's per-request timing fields of a request answered at `times.responded` (SGLang sends
    most of them with --enable-metrics; we always do). Durations in seconds; `*_ts` and the
    `forward_entry_time` / `prefill_finished_time` stamps in Unix seconds, as SGLang's."""
    to_unix = time.time() - time.perf_counter()
    # Never admitted (aborted while waiting, or max_new_tokens 0): it waited until it finished,
    # as SGLang's quick finish counts it.
    admitted = times.admitted or times.finished
    meta = {
        "e2e_latency": times.responded - times.created,
        "queue_time": admitted - times.queued,
        "inference_time": times.responded - admitted,
        "request_received_ts": times.created + to_unix,
        "request_finished_ts": times.responded + to_unix,
    }
    if times.admitted:
        meta["forward_entry_time"] = times.admitted + to_unix
    if times.first_token:
        meta["prefill_finished_time"] = times.first_token + to_unix
        # The tokens after the first over the time after it (the decode phase alone).
        decoding = times.finished - times.first_token
        if completion_tokens > 1 and decoding > 0:
            meta["decode_throughput"] = (completion_tokens - 1) / decoding
    return meta
