"""How a rollout is cut: optimizer steps, data-parallel shares, micro-batches (plain Python).

Every rank computes the same plan from the same whole-rollout lengths, so no rank waits on a
collective another rank never enters. Every rank must also run as many forward/backward passes
as the others for FSDP's all-gathers to pair up, so a step's micro-batch count is agreed from
the plan too.

A step counts executions, not samples, as slime's `--global-batch-size` does: an execution is
one run of the generate function (a `rollout_id`), and an agent session split into several
training samples is one execution whose samples all go to the same step. Without such splits
every sample is its own execution.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class StepPlan:
    """One optimizer step: this rank's micro-batches and the global normalisers."""

    micro_batches: list[list[int]]
    num_samples: int
    """Samples in the step, over every rank."""
    num_tokens: int
    """Loss-mask tokens in the step, over every rank (--calculate-per-token-loss divides by it)."""
    num_executions: int = 0
    """Executions in the step, over every rank: the per-sample loss is a mean over them. 0: as
    many as samples."""
    denominators: dict[int, int] | None = None
    """Per position in the part: the loss-mask tokens of its whole execution, which replace the
    sample's own in the per-sample mean (slime's `rollout_mask_sums`). None: every execution
    has one sample."""

    def __post_init__(self) -> None:
        if not self.num_executions:
            self.num_executions = self.num_samples

    def row_denominators(self, positions: Sequence[int]) -> list[int] | None:
        """`denominators` of a micro-batch's rows (None when each row is its own execution)."""
        return None if self.denominators is None else [self.denominators[p] for p in positions]


def execution_keys(rollout_ids: Sequence[int | None] | None, num_samples: int) -> list[int]:
    """Each sample's execution as 0, 1, ... in order of first appearance; a sample without a
    rollout id is an execution of its own."""
    if rollout_ids is None:
        return list(range(num_samples))
    keys: dict[object, int] = {}
    out = []
    for i, rid in enumerate(rollout_ids):
        out.append(keys.setdefault(("own", i) if rid is None else rid, len(keys)))
    return out


def split_steps(
    num_samples: int, global_batch_size: int | None, executions: Sequence[int] | None = None
) -> list[list[int]]:
    """Sample positions of each optimizer step, in rollout order: `global_batch_size`
    executions per step (`executions[i]`: sample i's, from `execution_keys`)."""
    members: dict[int, list[int]] = {}
    for i, key in enumerate(executions if executions is not None else range(num_samples)):
        members.setdefault(key, []).append(i)
    runs = list(members.values())
    size = global_batch_size or len(runs)
    if len(runs) % size:
        what = (
            f"{len(runs)} samples"
            if len(runs) == num_samples
            else (
                f"{len(runs)} executions (in {num_samples} samples: a rollout id with several samples "
                "counts once)"
            )
        )
        raise ValueError(
            f"the rollout has {what}, not a multiple of --global-batch-size {size} "
            "(rollout-batch-size × n-samples-per-prompt must be divisible by it)"
        )
    return [
        sorted(i for run in runs[start : start + size] for i in run) for start in range(0, len(runs), size)
    ]


def balanced_shares(indices: Sequence[int], lengths: Sequence[int], num_shares: int) -> list[list[int]]:
    """Split `indices` into `num_shares` shares of equal counts (or, when the count does not
    divide, counts one apart, the larger ones first) with similar token totals.

    Longest first, each to the share with the fewest tokens that still has room (LPT); ties go
    to the lower share. Equal counts keep a step's per-rank micro-batch counts equal when batches
    are not dynamic. Each share keeps rollout order.
    """
    if len(indices) < num_shares:
        raise ValueError(f"{len(indices)} samples cannot give each of {num_shares} data-parallel ranks one")
    base, extra = divmod(len(indices), num_shares)
    room = [base + (share < extra) for share in range(num_shares)]
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    heap = [(0, share) for share in range(num_shares)]
    shares: list[list[int]] = [[] for _ in range(num_shares)]
    for i in order:
        full = []
        while True:
            tokens, share = heapq.heappop(heap)
            if len(shares[share]) < room[share]:
                break
            full.append((tokens, share))
        shares[share].append(i)
        heapq.heappush(heap, (tokens + lengths[i], share))
        for item in full:
            heapq.heappush(heap, item)
    return [sorted(s) for s in shares]


def fixed_micro_batches(indices: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    """Consecutive micro-batches of `micro_batch_size` samples (the last may be shorter)."""
    return [list(indices[k : k + micro_batch_size]) for k in range(0, len(indices), micro_batch_size)]


def padded_tokens(batch: Sequence[int], lengths: Sequence[int]) -> int:
    """Tokens a right-padded micro-batch occupies: longest sample × number of samples."""
    return max((lengths[i] for i in batch), default=0) * len(batch)


def pack_micro_batches(
    indices: Sequence[int], lengths: Sequence[int], max_tokens: int, packed: bool = False
) -> list[list[int]]:
    """Pack samples into micro-batches whose size stays within `max_tokens`: padded size, or
    with `packed` (samples back to back in one row) the sum of their lengths.

    Samples are taken longest first, so each micro-batch holds samples of similar length and
    padding is small. A sample longer than the budget gets a micro-batch of its own (it cannot
    be split; the caller may warn).
    """

    def size(batch: list[int]) -> int:
        return sum(lengths[i] for i in batch) if packed else padded_tokens(batch, lengths)

    order = sorted(indices, key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        if batches and size([*batches[-1], i]) <= max_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def flops_coefficient(hf_config: Any) -> float:
    """--balance-by-flops: c in a sequence's forward FLOPs ~ L x (c + L), from the model's shape
    (slime's estimate: per layer 2Lh(a+2g)d + 2Lh^2 + 6Lh x ffn linear, 2aL^2d attention; the
    output layer 2LhV; a mixture of experts counts its routed and shared experts' width)."""
    c = getattr(hf_config, "text_config", None) or hf_config  # a vision-language model's text half
    h, layers, heads = c.hidden_size, c.num_hidden_layers, c.num_attention_heads
    groups = getattr(c, "num_key_value_heads", None) or heads
    d = getattr(c, "head_dim", None) or h // heads
    ffn = c.intermediate_size
    if getattr(c, "num_experts_per_tok", None):  # routed experts (Mixtral's are intermediate_size wide)
        width = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
        ffn = width * c.num_experts_per_tok + (getattr(c, "shared_expert_intermediate_size", 0) or 0)
    linear = layers * (2 * h * (heads + 2 * groups) * d + 2 * h * h + 6 * h * ffn) + 2 * h * c.vocab_size
    return linear / (2 * heads * d * layers)


def flops_micro_batches(
    indices: Sequence[int], lengths: Sequence[int], max_tokens: int, coefficient: float
) -> list[list[int]]:
    """--balance-by-flops: as many micro-batches as the token budget needs (ceil(tokens /
    `max_tokens`), at most one per sample), filled longest-FLOPs first into the lightest (LPT:
    within 4/3 of the best split; slime uses Karmarkar-Karp), each keeping rollout order."""
    count = min(len(indices), max(1, -(-sum(lengths[i] for i in indices) // max_tokens)))
    heap = [(0.0, k) for k in range(count)]
    batches: list[list[int]] = [[] for _ in range(count)]
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        load, k = heapq.heappop(heap)
        batches[k].append(i)
        heapq.heappush(heap, (load + lengths[i] * (coefficient + lengths[i]), k))
    return [sorted(b) for b in batches if b]


def split_to_count(batches: list[list[int]], count: int) -> list[list[int]]:
    """Split the largest micro-batches until there are `count` of them (at most the samples)."""
    out = [list(b) for b in batches]
    while len(out) < count:
        largest = max(range(len(out)), key=lambda k: len(out[k]))
        if len(out[largest]) < 2:
            raise ValueError(f"cannot split {sum(map(len, out))} samples into {count} micro-batches")
        b = out.pop(largest)
        half = len(b) // 2
        out[largest:largest] = [b[:half], b[half:]]
    return out


def merge_to_count(batches: list[list[int]], count: int, lengths: Sequence[int]) -> list[list[int]]:
    """Merge the two micro-batches with the fewest tokens until there are `count` of them."""
    out = [list(b) for b in batches]
    while len(out) > count:
        a, b = sorted(range(len(out)), key=lambda k: (sum(lengths[i] for i in out[k]), k))[:2]
        merged = sorted(out[a] + out[b], key=lambda i: (-lengths[i], i))
        out = [m for k, m in enumerate(out) if k not in (a, b)]
        out.insert(min(a, b), merged)
    return out


def rank_micro_batches(
    per_rank: list[list[list[int]]], shares: list[list[int]], lengths: Sequence[int]
) -> tuple[list[list[list[int]]], bool]:
    """Every rank's micro-batches brought to one count: the most any rank packed, unless a rank
    holds fewer samples than that (a step whose sample count the ranks do not divide: several
    samples per execution); then the smallest share's size, the ranks with more micro-batches
    merging their smallest. Returns them and whether any merge happened (a merged micro-batch
    may exceed the token budget)."""
    count = min(max(len(mbs) for mbs in per_rank), min(len(s) for s in shares))
    merged = any(len(mbs) > count for mbs in per_rank)
    return [
        merge_to_count(mbs, count, lengths) if len(mbs) > count else split_to_count(mbs, count)
        for mbs in per_rank
    ], merged


def warn_merged(num_samples: int, dp_size: int, dynamic: bool) -> None:
    logger.warning(
        "a step of %d samples (several per execution) does not split evenly over %d data-parallel ranks: "
        "micro-batches were merged to keep the ranks in step, and may exceed %s",
        num_samples,
        dp_size,
        "--max-tokens-per-gpu" if dynamic else "--micro-batch-size",
    )


def execution_normalisers(
    step: Sequence[int], loss_tokens: Sequence[int], executions: Sequence[int] | None, local: dict[int, int]
) -> tuple[int, dict[int, int] | None]:
    """A step's executions count and, when some execution has several samples, each of this
    rank's samples' execution loss-mask tokens keyed by its position in the part (`local`:
    rollout position -> part position), as `StepPlan` holds them."""
    if executions is None:
        return len(step), None
    totals: dict[int, int] = {}
    for g in step:
        totals[executions[g]] = totals.get(executions[g], 0) + loss_tokens[g]
    return len(totals), {local[g]: totals[executions[g]] for g in step if g in local}


def step_shares(
    lengths: Sequence[int], global_batch: int, dp_size: int, executions: Sequence[int] | None = None
) -> list[list[list[int]]]:
    """For each optimizer step, every data-parallel rank's sample positions (`balanced_shares` of
    the step). The rollout manager splits a rollout with it and every rank plans with it, so the
    part a rank receives is the part it would have picked from the whole rollout."""
    steps = split_steps(len(lengths), global_batch, executions)
    return [balanced_shares(step, lengths, dp_size) for step in steps]
