"""Forward passes over micro-batches: response log-probs and entropy.

A micro-batch is a list of samples, laid out one of two ways:

- padded: one row per sample, padded on the right to the longest sample;
- packed: one row holding every sample back to back, no padding, positions restarting at 0 for
  each sample. With no attention mask and no KV cache, Hugging Face's attention (sdpa, eager,
  flex, flash-attn varlen) derives each sample's boundaries from the restarting positions, so
  a token attends only to the tokens of its own sample.

Logits are only computed where a response token is predicted (`logits_to_keep`), so the
vocabulary-sized activations cover the responses, not the prompts. Log-probs use
logits / temperature, the distribution the engine sampled from.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from slime.algo.losses import entropy_from_logits

PAD_ID = 0


@dataclass
class MicroBatch:
    """Padded inputs of one micro-batch and where each sample's response lies.

    Response tensors are [batch, max_response_len]; `response_mask` marks real response tokens
    (padding 0), `loss_mask` additionally zeroes tokens excluded from the loss.
    """

    positions: list[int]  # positions in the rollout batch
    input_ids: torch.Tensor  # [batch, longest] padded; [1, total tokens] packed
    attention_mask: torch.Tensor | None  # None when packed
    prompt_lengths: list[int]
    response_lengths: list[int]
    response_mask: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor | None = None
    """Packed: [1, total tokens], restarting at 0 for each sample (None when padded)."""
    offsets: list[int] | None = None
    """Packed: where each sample starts in the row."""

    @property
    def packed(self) -> bool:
        return self.position_ids is not None

    @property
    def num_samples(self) -> int:
        return len(self.positions)

    def response_tensor(self, per_sample: list[list[float]] | list[torch.Tensor]) -> torch.Tensor:
        """Lay per-sample response values out as [batch, max_response_len] (0-padded)."""
        out = torch.zeros(self.response_mask.shape, dtype=torch.float32)
        for row, values in enumerate(per_sample):
            values_t = torch.as_tensor(values, dtype=torch.float32)
            out[row, : values_t.numel()] = values_t
        return out


def make_micro_batch(
    positions: list[int],
    tokens: list[list[int]],
    response_lengths: list[int],
    loss_masks: list[list[int]] | None,
    device: torch.device,
    packed: bool = False,
) -> MicroBatch:
    """The samples at `positions` as one micro-batch, right-padded or packed (module docstring)."""
    max_resp = max(response_lengths[p] for p in positions)
    resp_mask = torch.zeros((len(positions), max_resp))
    loss_mask = torch.zeros_like(resp_mask)
    for row, p in enumerate(positions):
        r = response_lengths[p]
        resp_mask[row, :r] = 1
        loss_mask[row, :r] = torch.tensor(loss_masks[p], dtype=torch.float32) if loss_masks is not None else 1
    mb = MicroBatch(
        positions=list(positions),
        input_ids=torch.empty(0, dtype=torch.long),
        attention_mask=None,
        prompt_lengths=[len(tokens[p]) - response_lengths[p] for p in positions],
        response_lengths=[response_lengths[p] for p in positions],
        response_mask=resp_mask,
        loss_mask=loss_mask,
    )
    if packed:
        lengths = [len(tokens[p]) for p in positions]
        mb.offsets = list(itertools.accumulate(lengths[:-1], initial=0))
        mb.input_ids = torch.tensor([t for p in positions for t in tokens[p]], dtype=torch.long)[None].to(
            device
        )
        mb.position_ids = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
        return mb
    ids = torch.full((len(positions), max(len(tokens[p]) for p in positions)), PAD_ID, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for row, p in enumerate(positions):
        seq = tokens[p]
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[row, : len(seq)] = 1
    mb.input_ids, mb.attention_mask = ids.to(device), attn.to(device)
    return mb


def response_log_probs(
    model: torch.nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of every response token, each [batch, max_response_len] float32 on CPU
    layout of `mb.response_mask` (values past a sample's response are 0).

    Token t of the sequence is predicted by the logits at t - 1, so the response of a sample
    with prompt length P and response length R reads logits at P - 1 .. P + R - 2.
    """
    if mb.packed:
        return _packed_log_probs(model, mb, temperature, with_entropy)
    seq_len = mb.input_ids.shape[1]
    first = min(mb.prompt_lengths) - 1
    keep = seq_len - first
    out = model(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, logits_to_keep=keep, use_cache=False
    )
    logits = out.logits  # [B, keep, V], position j is sequence position first + j
    max_resp = mb.response_mask.shape[1]
    rows, cols = [], []
    for row, (p, r) in enumerate(zip(mb.prompt_lengths, mb.response_lengths)):
        start = p - 1 - first
        idx = torch.arange(max_resp)
        idx = torch.where(idx < r, start + idx, start)  # padding reads a valid position, masked later
        rows.append(torch.full((max_resp,), row))
        cols.append(idx)
    row_idx = torch.stack(rows).to(logits.device)
    col_idx = torch.stack(cols).to(logits.device)
    resp_logits = logits[row_idx, col_idx].float() / temperature  # [B, R, V]
    targets = mb.input_ids.gather(1, (col_idx + first + 1).clamp(max=seq_len - 1))
    log_probs = torch.log_softmax(resp_logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    mask = mb.response_mask.to(log_probs.device)
    log_probs = log_probs * mask
    entropy = entropy_from_logits(resp_logits) * mask if with_entropy else None
    return log_probs, entropy


def _packed_log_probs(
    model: torch.nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`response_log_probs` of a packed micro-batch, in the same [batch, max_response_len] layout."""
    assert mb.offsets is not None
    predictors, targets = [], []
    for o, p, r in zip(mb.offsets, mb.prompt_lengths, mb.response_lengths):
        predictors.append(torch.arange(o + p - 1, o + p + r - 1))  # logits at t - 1 predict token t
        targets.append(torch.arange(o + p, o + p + r))
    device = mb.input_ids.device
    cu = torch.tensor([*mb.offsets, mb.input_ids.shape[1]], dtype=torch.int32, device=device)
    longest = max(p + r for p, r in zip(mb.prompt_lengths, mb.response_lengths))
    out = model(input_ids=mb.input_ids, position_ids=mb.position_ids, logits_to_keep=torch.cat(predictors).to(device),
                use_cache=False, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)  # fmt: skip
    logits = out.logits[0].float() / temperature  # [response tokens, V]
    ids = mb.input_ids[0, torch.cat(targets).to(device)]
    flat = torch.log_softmax(logits, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    rows = torch.cat([torch.full((r,), row) for row, r in enumerate(mb.response_lengths)]).to(flat.device)
    cols = torch.cat([torch.arange(r) for r in mb.response_lengths]).to(flat.device)
    log_probs = torch.zeros(mb.response_mask.shape, dtype=flat.dtype, device=flat.device).index_put(
        (rows, cols), flat
    )
    entropy = None
    if with_entropy:
        entropy = torch.zeros_like(log_probs).index_put((rows, cols), entropy_from_logits(logits))
    return log_probs, entropy
