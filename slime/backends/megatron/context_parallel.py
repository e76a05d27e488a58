"""Context parallelism (`--context-parallel-size CP`) for the Megatron actor's local layer spec.

Each sequence of a micro-batch is split over the CP ranks of its data-parallel replica, as
megatron-core lays it out for Transformer Engine: the sequence, padded to a multiple of 2 x CP,
is cut into 2 x CP equal chunks and rank r holds chunks r and 2 x CP - 1 - r (the causal work is
then even). Every micro-batch runs in megatron-core's packed (THD) layout, padded rows too (each
sample a sequence of its own); `PackedSeqParams` carries the padded sequences' global bounds, from
which megatron-core's rotary embedding takes each rank's positions.

- Attention (`cp_attention`): each rank's keys and values are all-gathered over the CP group and
  put back in sequence order; each local query attends causally to its own sequence's keys by
  position. Backward: the keys' and values' gradients are summed over the CP ranks and each rank
  keeps its own (an all-reduce: gloo has no reduce-scatter).
- Log-probs and entropy are computed for the local tokens (their next token is known on every
  rank: the whole micro-batch is), then all-gathered into sequence order (`gather_tokens`), so
  the loss is the one without CP, computed alike on every CP rank; backward keeps each rank's own
  slice, and the parameters' gradients are summed over DP x CP (slime.backends.megatron.grads).
- Step metrics and rollout data come from CP rank 0 only (the others computed the same values).

With the local layer spec the attention is this module's: torch's attention with an explicit
causal mask per sequence (memory: local tokens x sequence length, per sequence). With
`--transformer-impl transformer_engine` it is Transformer Engine's own context-parallel attention,
which takes this same layout (THD, the padded bounds, the load-balanced chunks); that path is built
but has never run (no machine here has Transformer Engine).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from slime.backends.micro_batch import PAD_ID, MicroBatch, bounds_on, host_bounds
from slime.utils.transfer import to_device


def chunk_positions(length: int, cp: int, rank: int) -> torch.Tensor:
    """Positions (in a sequence of `length`, a multiple of 2 x cp) that CP rank `rank` holds."""
    c = length // (2 * cp)
    return torch.cat(
        [torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]
    )


def local_order(cu: list[int], cp: int, rank: int) -> torch.Tensor:
    """Where each of rank `rank`'s tokens sits in the padded global row (bounds `cu`)."""
    return torch.cat([a + chunk_positions(b - a, cp, rank) for a, b in itertools.pairwise(cu)])


@dataclass
class CPView:
    """This CP rank's share of a micro-batch, in the THD layout (module docstring). Every index
    below is computed on the host when the view is cut and uploaded once, so that the layers and
    the loss use it without reading the device."""

    ids: torch.Tensor
    """[1, local tokens] this rank's input ids."""
    position_ids: torch.Tensor
    """[1, local tokens] each token's position in its sequence."""
    packed: Any
    """megatron-core's PackedSeqParams: the padded sequences' global bounds."""
    targets: torch.Tensor
    """[local tokens] the next token of each local token in its sequence (PAD_ID at a sequence's end)."""
    real: torch.Tensor
    """[1, local tokens] bool: a sample's token, not padding."""
    cp: int
    group: Any
    where: torch.Tensor
    """On the host, [rows, length] of the micro-batch: each real token's place in the padded
    global row (-1: padding)."""
    own: tuple[torch.Tensor, torch.Tensor]
    """The micro-batch's tokens this rank holds: their places in the micro-batch's [rows x length]
    flattened, and among this rank's tokens."""
    predicting: tuple[torch.Tensor, torch.Tensor]
    """This rank's tokens that predict a response token (their places among its tokens), and for
    every response token, in `MicroBatch.predictions` order, the place in the padded global row of
    the token that predicts it."""

    def local(self, values: torch.Tensor) -> torch.Tensor:
        """[rows, length] values over the micro-batch's tokens -> [1, local tokens] (0 on padding)."""
        source, place = self.own
        out = values.new_zeros(self.ids.shape[1])
        return out.index_put((place,), values.reshape(-1)[source]).unsqueeze(0)


def cp_view(
    mb: MicroBatch, cp: int, rank: int, group: Any, multiple: int = 1, local_spec: bool = False
) -> CPView:
    """The CP share of `mb` (packed or padded) for CP rank `rank`; each sequence padded to a
    multiple of 2 x cp x `multiple` (sequence parallelism: TP, so each rank's share splits over TP).
    `local_spec`: megatron-core's local layer spec (`_thd_params`)."""
    device = mb.input_ids.device
    assert mb.host_ids is not None, "a micro-batch from make_micro_batch"
    flat = mb.host_ids.reshape(-1)
    width = mb.input_ids.shape[1]
    where = torch.full(mb.input_ids.shape, -1, dtype=torch.long)
    padded_ids, real, cu = [], [], [0]
    for row, (start, p, r) in enumerate(
        zip(mb.token_starts(), mb.prompt_lengths, mb.response_lengths, strict=True)
    ):
        n = p + r
        padded = -(-n // (2 * cp * multiple)) * (2 * cp * multiple)
        tokens = torch.full((padded,), PAD_ID, dtype=torch.long)
        tokens[:n] = flat[start : start + n]
        padded_ids.append(tokens)
        real.append(torch.arange(padded) < n)
        # `start` is row * width + column for a padded micro-batch, the column for a packed one
        r_, col = (0, start) if mb.packed else (row, start - row * width)
        where[r_, col : col + n] = cu[-1] + torch.arange(n)
        cu.append(cu[-1] + padded)
    ids, real_t = torch.cat(padded_ids), torch.cat(real)
    nxt = torch.full_like(ids, PAD_ID)
    for a, b in itertools.pairwise(cu):
        nxt[a : b - 1] = ids[a + 1 : b]
    order = local_order(cu, cp, rank)
    positions = torch.cat([chunk_positions(b - a, cp, rank) for a, b in itertools.pairwise(cu)])
    mine = torch.full((cu[-1],), -1, dtype=torch.long)
    mine[order] = torch.arange(order.numel())
    longest = max(b - a for a, b in itertools.pairwise(cu))
    up = functools.partial(to_device, device=device)
    return CPView(
        up(ids[order].unsqueeze(0)),
        up(positions.unsqueeze(0)),
        _thd_params(bounds_on(cu, device), longest, local_spec),
        up(nxt[order]),
        up(real_t[order].unsqueeze(0)),
        cp,
        group,
        where,
        _own_places(where, mine, up),
        _predicting(mb, where, mine, up),
    )


def _own_places(where: torch.Tensor, mine: torch.Tensor, up: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """CPView.own, from `where` and `mine` (each global place's among this rank's tokens, -1:
    another rank's), on the host."""
    source = (where.reshape(-1) >= 0).nonzero()[:, 0]
    place = mine[where.reshape(-1)[source]]
    held = place >= 0
    return up(source[held]), up(place[held])


def _predicting(
    mb: MicroBatch, where: torch.Tensor, mine: torch.Tensor, up: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """CPView.predicting, on the host."""
    rows, cols = mb.prediction_places()
    at = where[rows, cols]
    local = mine[at]
    return up(local[local >= 0]), up(at)


class _GatherKeepOwn(torch.autograd.Function):
    """All-gather along dim 0 over the CP group; backward: this rank's slice of the gradient, as it
    is (every rank computed the same loss from the gathered values)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        ctx.rank, ctx.n = rank, t.shape[0]
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None, None, None


class _GatherSumGrads(torch.autograd.Function):
    """All-gather along dim 0 over the CP group; backward: the gradients summed over the ranks,
    this rank's slice kept (the keys and values every rank's queries read)."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, group: Any, rank: int, size: int) -> torch.Tensor:
        ctx.group, ctx.rank, ctx.n = group, rank, t.shape[0]
        parts = [torch.empty_like(t) for _ in range(size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank * ctx.n : (ctx.rank + 1) * ctx.n], None, None, None


def gather_tokens(local: torch.Tensor, view: CPView) -> torch.Tensor:
    """[local tokens] values -> [padded global tokens] in sequence order (autograd: own slice)."""
    group, cp = view.group, view.cp
    rank = dist.get_rank(group)
    gathered = _GatherKeepOwn.apply(local, group, rank, cp)
    return gathered[_orders(tuple(host_bounds(view.packed.cu_seqlens_q)), cp, rank, local.device).sequence]


def whole_sequences(local: torch.Tensor, cu: tuple[int, ...], group: Any) -> torch.Tensor:
    """[local tokens, ...] -> [padded global tokens, ...] (sequence bounds `cu`) in sequence
    order, for a layer every CP rank runs on whole sequences (backward: the gradients summed over
    the CP ranks, since each rank's outputs read earlier tokens of the others; each rank keeps its
    own)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    return _GatherSumGrads.apply(local, group, rank, cp)[_orders(cu, cp, rank, local.device).sequence]


def own_tokens(whole: torch.Tensor, cu: tuple[int, ...], group: Any) -> torch.Tensor:
    """The inverse of whole_sequences' gather: this CP rank's tokens of whole sequences."""
    return whole[_orders(cu, dist.get_world_size(group), dist.get_rank(group), whole.device).own]


@dataclass(frozen=True)
class _Orders:
    """Token orders of one micro-batch layout on the device, made once (not in every layer)."""

    own: torch.Tensor
    """local_order: where each of this rank's tokens sits in the padded global row."""
    sequence: torch.Tensor
    """For the padded global row: where each token sits in the ranks' gathered shares (rank 0's
    tokens, then rank 1's, ...)."""
    chunks: tuple[torch.Tensor, ...]
    """Per sequence, chunk_positions: the positions this rank holds."""


@functools.lru_cache(maxsize=8)
def _orders(cu: tuple[int, ...], cp: int, rank: int, device: torch.device) -> _Orders:
    """_Orders of the layout `cu` for CP rank `rank` (cached: every layer asks for the same)."""
    per_rank = [local_order(list(cu), cp, r) for r in range(cp)]
    order = torch.cat(per_rank)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    chunks = tuple(to_device(chunk_positions(b - a, cp, rank), device) for a, b in itertools.pairwise(cu))
    return _Orders(to_device(per_rank[rank], device), to_device(inverse, device), chunks)


def cp_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    packed: Any,
    group: Any,
    scale: float | None,
    dropout: float,
) -> torch.Tensor:
    """Causal attention of this rank's tokens ([local tokens, heads, dim], THD) over their whole
    sequences, the keys and values all-gathered over the CP group -> [local tokens, heads * dim]."""
    from megatron.core import tensor_parallel

    if packed is None or packed.qkv_format != "thd":
        raise NotImplementedError(
            "context parallelism runs packed (THD) micro-batches only (context_parallel.run_micro_batch)"
        )
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    cu = host_bounds(packed.cu_seqlens_q)
    orders = _orders(tuple(cu), cp, rank, query.device)
    k = _GatherSumGrads.apply(key, group, rank, cp)[orders.sequence]  # [global tokens, kv heads, dim]
    v = _GatherSumGrads.apply(value, group, rank, cp)[orders.sequence]
    gqa = {"enable_gqa": True} if query.shape[1] != k.shape[1] else {}
    outs, at = [], 0
    for (a, b), mine in zip(itertools.pairwise(cu), orders.chunks):
        q = query[at : at + mine.numel()].transpose(0, 1)  # [heads, local, dim]
        at += mine.numel()
        allowed = mine[:, None] >= torch.arange(b - a, device=query.device)[None, :]
        with tensor_parallel.get_cuda_rng_tracker().fork() if dropout else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(
                q,
                k[a:b].transpose(0, 1),
                v[a:b].transpose(0, 1),
                attn_mask=allowed,
                dropout_p=dropout,
                scale=scale,
                **gqa,
            )
        outs.append(out.transpose(0, 1))
    out = torch.cat(outs)
    return out.reshape(out.shape[0], -1)


def run_micro_batch(
    model: Any,
    mb: MicroBatch,
    extra: dict[str, Any],
    count_mask: bool,
    scatter: bool,
    cp: tuple[int, int, Any] | None,
    local_spec: bool = False,
) -> torch.Tensor:
    """The model's forward on `mb`: right-padded rows, packed rows (THD), or with `cp` (size,
    rank, group) this CP rank's share (`mb.cp` is set to its CPView, which the log-probs read).
    `count_mask`: give the routers megatron-core's padding mask (the expert-bias update counts only
    real tokens: slime.backends.megatron.moe.padding_mask; `scatter`: split over the
    sequence-parallel ranks). `local_spec`: the model has megatron-core's local layer spec, whose
    rotary embedding can take packed rows' bounds on the host (`_thd_params`)."""

    from slime.backends.megatron.moe import padding_mask, sequence_parallel_share

    if cp is not None:
        sp = model.config.tensor_model_parallel_size if model.config.sequence_parallel else 1
        view = mb.cp = cp_view(mb, *cp, sp, local_spec)
        if "labels" in extra:  # the MTP loss's targets (slime.backends.megatron.mtp): this rank's tokens
            extra = {**extra, "labels": view.ids, "loss_mask": view.local(extra["loss_mask"])}
        if count_mask:
            extra = {**extra, "padding_mask": sequence_parallel_share(~view.real, scatter)}
        return model(view.ids, view.position_ids, None, packed_seq_params=view.packed, **extra)
    if count_mask:
        extra = {**extra, "padding_mask": padding_mask(mb, scatter)}
    ids = mb.input_ids
    if mb.packed:  # megatron-core's THD layout: one row, the sequences' bounds in cu_seqlens
        packed = _thd_params(mb.cu_seq_lens(), mb.longest_segment(), local_spec)
        return model(ids, mb.position_ids, None, packed_seq_params=packed, **extra)
    positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
    return model(ids, positions, None, **extra)


def _thd_params(cu: torch.Tensor, longest: int, local_spec: bool) -> Any:
    """megatron-core's PackedSeqParams for a packed row with sequence bounds `cu` (on the device).

    With the local layer spec the `_padded` bounds, which megatron-core's rotary embedding reads
    first, are the same bounds on the host: its unfused rotary embedding (the fused one is off,
    slime.backends.megatron.model) reads them with `.tolist()` in every attention layer, which on
    a device tensor makes the host wait for the GPU twice a layer, and run behind it from then
    on. Nothing else of that spec reads them (our core attention takes `cu_seqlens_q`);
    Transformer Engine's attention reads them on the device, so its spec leaves them unset (and
    waits)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    host = torch.tensor(host_bounds(cu), dtype=torch.int32) if local_spec else None
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=longest,
        max_seqlen_kv=longest,
        cu_seqlens_q_padded=host,
        cu_seqlens_kv_padded=host,
    )


def cp_response_stats(mb: MicroBatch, local_stats: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B, max_response] log-probs (and entropy) of `mb`'s responses from `local_stats(index,
    targets)`, the stats of this rank's tokens at `index` (those that predict a response token:
    no float32 vocabulary rows for the prompts) against their next tokens, gathered over the CP
    ranks."""
    view = mb.cp
    assert isinstance(view, CPView)
    local, index = view.predicting
    log_probs, entropy = local_stats(local, view.targets[local])
    n = view.targets.numel()

    def spread(values: torch.Tensor) -> torch.Tensor:  # this rank's values at their places, gathered
        return gather_tokens(values.new_zeros(n).index_put((local,), values), view)[index]

    return mb.scatter(spread(log_probs)), None if entropy is None else mb.scatter(spread(entropy))
