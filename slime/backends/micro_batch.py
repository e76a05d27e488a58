"""Micro-batches as both train backends lay them out, and the per-token statistics of their responses.

A micro-batch is a list of samples, laid out one of two ways:

- padded: one row per sample, padded on the right to the longest sample;
- packed: one row holding every sample back to back, no padding, positions restarting at 0 for
  each sample, the samples' boundaries in `cu_seq_lens` (the cumulative lengths flash-attn's
  varlen kernels, Transformer Engine's THD format and slime.backends.packed_attention take).
  A backend that needs the row's length to be a multiple of some number (sequence parallelism
  splits it over TP ranks) gets a tail of padding as one more segment of its own.

The response statistics (log-probs, entropy) are computed only at the positions that predict a
response token, in sample order, optionally in chunks of `--log-probs-chunk-size` tokens so that
no [tokens x vocabulary] float32 tensor exists at once (`response_token_stats`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from slime.algo.losses import entropy_from_log_probs
from slime.utils.transfer import to_device

PAD_ID = 0

Stats = tuple[torch.Tensor, torch.Tensor | None]
"""Per-token log-probs and, when asked, entropies: each [tokens]."""

HOST_BOUNDS = "slime_host_bounds"
"""The attribute of a `cu_seq_lens` tensor holding its values as a list on the host."""


def bounds_on(bounds: list[int], device: torch.device) -> torch.Tensor:
    """Sequence bounds as a `cu_seq_lens` tensor (int32) on `device`, uploaded without a wait,
    carrying their values on the host (HOST_BOUNDS)."""
    cu = to_device(torch.tensor(bounds, dtype=torch.int32), device)
    setattr(cu, HOST_BOUNDS, bounds)
    return cu


def host_bounds(cu_seq_lens: torch.Tensor) -> list[int]:
    """The values of a `cu_seq_lens` tensor as a list, without reading the device where
    MicroBatch made it (it keeps them in HOST_BOUNDS)."""
    bounds = getattr(cu_seq_lens, HOST_BOUNDS, None)
    return bounds if bounds is not None else cu_seq_lens.tolist()


@dataclass
class MicroBatch:
    """Inputs of one micro-batch and where each sample's response lies.

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
    vision: dict[str, torch.Tensor] | None = None
    """A vision-language micro-batch: its images' `pixel_values` and `image_grid_thw`, and the
    multimodal rotary `position_ids` of its tokens (slime.backends.fsdp.vision)."""
    cp: object = None
    """Megatron with context parallelism: this rank's share, set by its forward
    (slime.backends.megatron.context_parallel.CPView)."""
    host_ids: torch.Tensor | None = None
    """`input_ids` as built, on the host (reading `input_ids` back would wait for the device)."""

    @property
    def packed(self) -> bool:
        return self.position_ids is not None

    @property
    def num_samples(self) -> int:
        return len(self.positions)

    def cu_seq_lens(self) -> torch.Tensor:
        """Packed: the segment boundaries [0, end of sample 0, ..., row length] (int32, on the
        inputs' device); a tail of padding is a segment of its own."""
        assert self.offsets is not None, "cu_seq_lens of a padded micro-batch"
        end = self.offsets[-1] + self.prompt_lengths[-1] + self.response_lengths[-1]
        bounds = [*self.offsets, end]
        if self.input_ids.shape[1] > end:
            bounds.append(self.input_ids.shape[1])
        return bounds_on(bounds, self.input_ids.device)

    def longest_segment(self) -> int:
        """Packed: the longest segment of the row (a sample, or the tail of padding)."""
        lengths = [p + r for p, r in zip(self.prompt_lengths, self.response_lengths)]
        return max([*lengths, self.input_ids.shape[1] - sum(lengths)])

    def token_starts(self) -> list[int]:
        """Where each sample's first token sits in `input_ids` flattened (row-major)."""
        if self.offsets is not None:
            return list(self.offsets)
        return [row * self.input_ids.shape[1] for row in range(self.num_samples)]

    def real_tokens(self) -> torch.Tensor:
        """[rows * length] bool over `input_ids` flattened: true at the samples' tokens (not padding)."""
        return self.sample_ids() >= 0

    def sample_ids(self, device: torch.device | None = None) -> torch.Tensor:
        """[rows * length] long over `input_ids` flattened: each token's sample (its index in the
        micro-batch), -1 at padding; on `device` (default: the inputs')."""
        device = self.input_ids.device if device is None else device
        out = torch.full((self.input_ids.numel(),), -1, dtype=torch.long, device=device)
        for i, (start, p, r) in enumerate(
            zip(self.token_starts(), self.prompt_lengths, self.response_lengths)
        ):
            out[start : start + p + r] = i
        return out

    def predictions(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where the response tokens are predicted, one entry per response token in sample order:
        the row of `input_ids` (always 0 when packed), the position whose logits predict the token
        (token t is predicted at t - 1) and the token's id."""
        row_t, col_t = (to_device(t, self.input_ids.device) for t in self.prediction_places())
        return row_t, col_t, self.input_ids[row_t, col_t + 1]

    def prediction_places(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`predictions`' rows and positions, on the host."""
        rows, cols = [], []
        starts = self.offsets or [0] * self.num_samples
        for row, (o, p, r) in enumerate(zip(starts, self.prompt_lengths, self.response_lengths)):
            rows.append(torch.full((r,), 0 if self.packed else row, dtype=torch.long))
            cols.append(torch.arange(o + p - 1, o + p + r - 1))
        return torch.cat(rows), torch.cat(cols)

    def scatter(self, flat: torch.Tensor) -> torch.Tensor:
        """Per-token values in `predictions` order -> [batch, max_response_len] (0 past each response)."""
        rows = to_device(
            torch.cat([torch.full((r,), row) for row, r in enumerate(self.response_lengths)]), flat.device
        )
        cols = to_device(torch.cat([torch.arange(r) for r in self.response_lengths]), flat.device)
        out = torch.zeros(self.response_mask.shape, dtype=flat.dtype, device=flat.device)
        return out.index_put((rows, cols), flat)

    def laid_out(self, per_position: Any, device: torch.device) -> torch.Tensor:
        """The values `per_position` holds for this micro-batch's samples (indexed by position),
        laid out as `response_tensor` does, on `device` (uploaded without a wait)."""
        return to_device(self.response_tensor([per_position[p] for p in self.positions]), device)

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
    multiple_of: int = 1,
) -> MicroBatch:
    """The samples at `positions` as one micro-batch, right-padded or packed (module docstring),
    its sequence length padded to a multiple of `multiple_of`."""
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
        tail = -sum(lengths) % multiple_of
        mb.offsets = list(itertools.accumulate(lengths[:-1], initial=0))
        flat = [t for p in positions for t in tokens[p]] + [PAD_ID] * tail
        mb.host_ids = torch.tensor(flat, dtype=torch.long)[None]
        mb.input_ids = to_device(mb.host_ids, device)
        mb.position_ids = to_device(torch.cat([torch.arange(n) for n in [*lengths, tail] if n])[None], device)
        return mb
    longest = max(len(tokens[p]) for p in positions)
    ids = torch.full((len(positions), longest - longest % -multiple_of), PAD_ID, dtype=torch.long)
    attn = torch.zeros_like(ids)
    for row, p in enumerate(positions):
        seq = tokens[p]
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        attn[row, : len(seq)] = 1
    mb.host_ids, mb.input_ids, mb.attention_mask = ids, to_device(ids, device), to_device(attn, device)
    return mb


def softmax_stats(with_entropy: bool) -> Callable[[torch.Tensor, torch.Tensor], Stats]:
    """Log-probs of the targets (and entropy) from rows of full-vocabulary logits."""

    def stats(logits: torch.Tensor, targets: torch.Tensor) -> Stats:
        log_p = torch.log_softmax(logits, dim=-1)
        entropy = entropy_from_log_probs(log_p) if with_entropy else None
        return log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy

    return stats


def response_token_stats(
    logits: torch.Tensor,
    index: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    stats: Callable[[torch.Tensor, torch.Tensor], Stats],
    chunk_size: int = -1,
) -> Stats:
    """`stats` of the rows `logits[index]` (all rows, in order, when `index` is None), divided by
    the temperature in float32, against `targets`.

    With `chunk_size` > 0 (`--log-probs-chunk-size`) the rows go through `stats` that many at a
    time, so its float32 copies, softmax and entropy terms exist for one chunk at once instead of
    for every token. When gradients are needed each chunk is recomputed in the backward pass
    (torch.utils.checkpoint) rather than kept, so the saving holds in training too; the values
    and gradients are those of the unchunked computation. The chunks are views of one tensor
    (`split`), whose backward assembles one gradient; indexing per chunk would allocate a
    gradient of the full logits for every chunk.
    """

    def piece(rows_: torch.Tensor, targets_: torch.Tensor) -> Stats:
        return stats(rows_.float() / temperature, targets_)

    rows = logits if index is None else logits[index]
    if chunk_size <= 0 or rows.shape[0] <= chunk_size:
        return piece(rows, targets)
    from torch.utils.checkpoint import checkpoint

    recompute = torch.is_grad_enabled() and rows.requires_grad
    parts = []
    for chunk, chunk_targets in zip(rows.split(chunk_size), targets.split(chunk_size)):
        if recompute:
            parts.append(checkpoint(piece, chunk, chunk_targets, use_reentrant=False))
        else:
            parts.append(piece(chunk, chunk_targets))
    log_probs = torch.cat([lp for lp, _ in parts])
    entropies = [e for _, e in parts if e is not None]
    return log_probs, torch.cat(entropies) if entropies else None
