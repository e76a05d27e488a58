"""Forward passes of a Hugging Face model over micro-batches (slime.backends.micro_batch): response
log-probs and entropy.

Packed micro-batches go in with restarting `position_ids`, no attention mask, no KV cache, and the
samples' boundaries as `cu_seq_lens_q/k` (what flash-attn's varlen path and
slime.backends.packed_attention read; Hugging Face's sdpa, eager and flex paths find the
boundaries from the restarting positions), so a token attends only to the tokens of its own sample.

Logits are only computed where a response token is predicted (`logits_to_keep`), so the
vocabulary-sized activations cover the responses, not the prompts. Log-probs use
logits / temperature, the distribution the engine sampled from.
"""

from __future__ import annotations

import torch

from slime.backends.micro_batch import MicroBatch, response_token_stats, softmax_stats


def response_log_probs(
    model: torch.nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool, chunk_size: int = -1
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of every response token, each [batch, max_response_len] in the
    layout of `mb.response_mask` (values past a sample's response are 0). `chunk_size`:
    --log-probs-chunk-size (slime.backends.micro_batch.response_token_stats)."""
    rows, cols, targets = mb.predictions()
    # a vision-language micro-batch's images and rotary positions (the model casts the pixels itself)
    images = dict(mb.vision or {})
    if mb.packed:
        cu, longest = mb.cu_seq_lens(), mb.longest_segment()
        position_ids = images.pop("position_ids", mb.position_ids)
        out = model(
            input_ids=mb.input_ids,
            position_ids=position_ids,
            logits_to_keep=cols,
            use_cache=False,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=longest,
            max_length_k=longest,
            **images,
        )
        # [response tokens, V] in `predictions` order (a view: no copy in backward)
        logits = out.logits.flatten(0, 1)
        index = None
    else:
        first = min(mb.prompt_lengths) - 1  # no response token is predicted before this position
        keep = mb.input_ids.shape[1] - first
        out = model(
            input_ids=mb.input_ids,
            attention_mask=mb.attention_mask,
            logits_to_keep=keep,
            use_cache=False,
            **images,
        )
        # [batch * keep, V]: position j of row b is sequence position first + j
        logits = out.logits.flatten(0, 1)
        index = rows * keep + cols - first
    log_probs, entropy = response_token_stats(
        logits, index, targets, temperature, softmax_stats(with_entropy), chunk_size
    )
    return mb.scatter(log_probs), None if entropy is None else mb.scatter(entropy)


def response_values(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """A value model's value of every response token, [batch, max_response_len] like
    `response_log_probs`: token t's value is read at position t - 1 (the prefix before it, where
    its log-prob is predicted), as slime's critic does. `model` returns one output per position
    (Hugging Face's *ForTokenClassification with num_labels 1)."""
    rows, cols, _ = mb.predictions()
    if mb.packed:
        cu, longest = mb.cu_seq_lens(), mb.longest_segment()
        out = model(
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            use_cache=False,
            cu_seq_lens_q=cu,
            cu_seq_lens_k=cu,
            max_length_q=longest,
            max_length_k=longest,
        )
    else:
        out = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False)
    return mb.scatter(out.logits[rows, cols, 0].float())
