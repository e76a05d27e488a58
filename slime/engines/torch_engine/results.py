"""SGLang's /generate response for a finished sequence of the torch engine."""

from __future__ import annotations

import base64
import time
from typing import Any

import torch

from slime.engines.torch_engine.sequence import Sequence


def result_of(engine: Any, seq: Sequence, started: float) -> dict[str, Any]:
    """SGLang's /generate response object for one finished sequence of `engine` (a TorchEngine)."""
    text = engine._detokenize(seq.output_ids, seq.params.skip_special_tokens)
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
        "e2e_latency": time.perf_counter() - started,
    }
    if seq.return_logprob:
        texts = engine._token_texts if seq.return_text_in_logprobs else (lambda ids: [None] * len(ids))
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
    return {"text": text, "output_ids": list(seq.output_ids), "meta_info": meta}
