"""Input-token log-probs of prompts (SGLang's `return_logprob` with `logprob_start_len`): a
teacher-forced forward of whole prompts, apart from the runners' KV caches."""

from __future__ import annotations

from typing import Any

import torch

from slime.engines.torch_engine.runner import lora_rows


@torch.inference_mode()
def input_log_probs(
    model: Any,
    prompts: list[list[int]],
    starts: list[int],
    temperatures: list[float],
    max_tokens: int,
    one_by_one: bool = False,
    adapters: Any = None,
    loras: list[Any] | None = None,
) -> list[list[float | None]]:
    """Each prompt's input-token log-probs from position `starts[i]` on, in SGLang's layout: the
    first entry is None whatever the start (SGLang reports no value there), then log
    softmax(logits / temperature) of each later token given the tokens before it (plain log
    softmax at temperature 0, like the sampled tokens'). A teacher-forced forward of whole prompts, apart
    from the KV cache; prompts are right-padded into batches of at most `max_tokens` padded tokens
    (`one_by_one`: each alone, for batch invariance). Causal attention keeps right padding out of
    the real positions. `adapters` / `loras`: the served LoRA adapters and each prompt's (or None)."""
    device = next(model.parameters()).device
    out: list[list[float | None]] = [[] for _ in prompts]
    batch: list[int] = []

    def run(rows: list[int]) -> None:
        width = max(len(prompts[i]) for i in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long, device=device)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            ids[r, : len(prompts[i])] = torch.tensor(prompts[i], device=device)
            mask[r, : len(prompts[i])] = 1
        with lora_rows(adapters, [loras[i] for i in rows] if loras else []):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        for r, i in enumerate(rows):
            first = starts[i] + 1
            # position t's token is predicted by position t - 1's logits
            pred = logits[r, first - 1 : len(prompts[i]) - 1].float()
            if temperatures[i] > 0:
                pred = pred / temperatures[i]
            target = torch.tensor(prompts[i][first:], device=device)
            values = torch.log_softmax(pred, dim=-1).gather(-1, target[:, None])[:, 0]
            out[i] = [None, *values.cpu().tolist()]

    for i in sorted(range(len(prompts)), key=lambda i: len(prompts[i])):
        width = len(prompts[i])  # sorted: the newest is the longest
        if batch and (one_by_one or width * (len(batch) + 1) > max_tokens):
            run(batch)
            batch = []
        batch.append(i)
    if batch:
        run(batch)
    return out
