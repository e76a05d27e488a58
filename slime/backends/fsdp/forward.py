"""Forward passes over right-padded micro-batches: response log-probs and entropy.

A micro-batch is a list of samples padded on the right to its longest sample. Logits are
only kept from the first response position on (`logits_to_keep`), so the vocabulary-sized
activations cover the response part, not the prompt. Log-probs use logits / temperature,
the distribution the engine sampled from.
"""

from __future__ import annotations

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
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_lengths: list[int]
    response_lengths: list[int]
    response_mask: torch.Tensor
    loss_mask: torch.Tensor

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
) -> MicroBatch:
    """Right-pad the samples at `positions` into one micro-batch."""
    max_len = max(len(tokens[p]) for p in positions)
    max_resp = max(response_lengths[p] for p in positions)
    ids = torch.full((len(positions), max_len), PAD_ID, dtype=torch.long)
    attn = torch.zeros_like(ids)
    resp_mask = torch.zeros((len(positions), max_resp))
    loss_mask = torch.zeros_like(resp_mask)
    for row, p in enumerate(positions):
        seq = tokens[p]
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[row, : len(seq)] = 1
        r = response_lengths[p]
        resp_mask[row, :r] = 1
        loss_mask[row, :r] = torch.tensor(loss_masks[p], dtype=torch.float32) if loss_masks is not None else 1
    return MicroBatch(
        positions=list(positions),
        input_ids=ids.to(device),
        attention_mask=attn.to(device),
        prompt_lengths=[len(tokens[p]) - response_lengths[p] for p in positions],
        response_lengths=[response_lengths[p] for p in positions],
        response_mask=resp_mask,
        loss_mask=loss_mask,
    )


def response_log_probs(
    model: torch.nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropy) of every response token, each [batch, max_response_len] float32 on CPU
    layout of `mb.response_mask` (values past a sample's response are 0).

    Token t of the sequence is predicted by the logits at t - 1, so the response of a sample
    with prompt length P and response length R reads logits at P - 1 .. P + R - 2.
    """
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
