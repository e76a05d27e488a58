"""Token log-probs and entropy from vocabulary-parallel logits, padded vocabulary rows excluded.

With TP the output layer gives each rank the logits of its slice of the padded vocabulary
(`padded / tp` columns). The columns past the real vocabulary (the padding,
slime.backends.megatron.convert) are set to -inf before anything else, so they take no
probability mass, appear in no log-prob or entropy, and get exactly zero gradient (the padded
rows of the output layer stay as they are: zero). The max, the softmax denominator, the target's
logit and the entropy's sum are summed over the TP group (identity in the backward, as in
megatron-core), so each rank's gradient is that of a log-softmax over the real vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slime.backends.megatron.context_parallel import cp_response_stats
from slime.backends.megatron.export import Mesh
from slime.backends.micro_batch import MicroBatch, Stats, response_token_stats


class _SumOverTP(torch.autograd.Function):
    """Sum over the TP group forward; identity backward: every TP rank computes the same loss
    from the summed value, so each rank's gradient for its own columns is its local one (summing
    the ranks' gradients would count the loss tp times). megatron-core's
    reduce_from_tensor_model_parallel_region does the same."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any) -> torch.Tensor:
        out = t.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _all_reduce(t: torch.Tensor, group: Any, tp: int) -> torch.Tensor:
    return t if tp == 1 else _SumOverTP.apply(t, group)


def vocab_parallel_log_probs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    vocab_size: int,
    tp_rank: int = 0,
    tp: int = 1,
    group: Any = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) for each position, and the entropy when asked.

    Args:
        logits: [..., padded_vocab / tp], this rank's columns (already divided by the temperature).
        targets: [...] token ids in the real vocabulary.
        vocab_size: the real vocabulary size (columns at or past it are padding).
    """
    shard = logits.shape[-1]
    start = tp_rank * shard
    real = max(0, min(shard, vocab_size - start))
    if real < shard:
        logits = logits.clone()
        logits[..., real:] = float("-inf")
    if real == 0:  # a rank holding only padding: no mass, but it must still take part in the reductions
        local_max = torch.full(logits.shape[:-1], float("-inf"), dtype=logits.dtype, device=logits.device)
    else:
        local_max = logits[..., :real].detach().max(dim=-1).values
    if tp > 1:
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - local_max.unsqueeze(-1)
    exp = shifted.exp()  # exp(-inf) = 0 for the padding
    sum_exp = _all_reduce(exp.sum(dim=-1), group, tp)
    local = targets - start
    mine = (local >= 0) & (local < real)
    picked = shifted.gather(-1, local.clamp(0, max(real - 1, 0)).unsqueeze(-1)).squeeze(-1)
    target = _all_reduce(torch.where(mine, picked, torch.zeros_like(picked)), group, tp)
    log_z = sum_exp.log()
    log_probs = target - log_z
    entropy = None
    if with_entropy:
        # H = log Z - sum p * shifted. On the padding p = 0 and shifted = -inf: use 0 for shifted
        # there (0 * -inf would be nan, in the value and in its gradient).
        safe = shifted.masked_fill(torch.isinf(shifted.detach()), 0.0)
        weighted = (exp * safe).sum(dim=-1)
        entropy = log_z - _all_reduce(weighted, group, tp) / sum_exp
    return log_probs, entropy


def from_last_stage(
    values: dict[int, torch.Tensor],
    positions: list[int],
    sizes: list[int],
    last_stage: bool,
    device: torch.device,
    pp_group: Any,
) -> dict[int, torch.Tensor]:
    """Per-sample values (`sizes` long, at `positions`) that the last pipeline stage computed,
    broadcast to every stage of the pipeline (the others pass nothing in `values`)."""
    from megatron.core import parallel_state as ps

    flat = (torch.cat([values[p] for p in positions]) if last_stage else torch.empty(sum(sizes))).to(device)
    dist.broadcast(flat, src=ps.get_pipeline_model_parallel_last_rank(), group=pp_group)
    return dict(zip(positions, flat.cpu().split(sizes)))


def response_log_probs(
    logits: torch.Tensor,
    mb: MicroBatch,
    vocab_size: int,
    mesh: Mesh,
    temperature: float,
    chunk_size: int,
    with_entropy: bool,
) -> Stats:
    """[B, max_response] log-probs (and entropy) of micro-batch `mb`'s responses from a rank's
    columns of the [rows, tokens, padded vocabulary / TP] logits (`vocab_size`: the real
    vocabulary's). With context parallelism every local token's, gathered over the CP ranks."""

    def stats(logits_: torch.Tensor, targets: torch.Tensor) -> Stats:
        return vocab_parallel_log_probs(
            logits_, targets, vocab_size, mesh.tp_rank, mesh.tp, mesh.tp_group, with_entropy
        )

    def at(index: torch.Tensor | None, targets: torch.Tensor) -> Stats:
        return response_token_stats(logits.flatten(0, 1), index, targets, temperature, stats, chunk_size)

    if mb.cp is not None:
        return cp_response_stats(mb, at)
    rows, cols, targets = mb.predictions()
    log_probs, entropy = at(rows * logits.shape[1] + cols, targets)
    return mb.scatter(log_probs), None if entropy is None else mb.scatter(entropy)
