"""How a rollout is cut: optimizer steps, data-parallel shares, micro-batches (plain Python).

Every rank computes the same plan from the same whole-rollout lengths, so no rank waits on a
collective another rank never enters. The only exchanged number is the micro-batch count of a
step (the maximum over ranks), because every rank must run as many forward/backward passes as
the others for FSDP's all-gathers to pair up.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class StepPlan:
    """One optimizer step: this rank's micro-batches and the global normalisers."""

    micro_batches: list[list[int]]
    num_samples: int
    num_tokens: int


def split_steps(num_samples: int, global_batch_size: int | None) -> list[list[int]]:
    """Sample positions of each optimizer step, in rollout order."""
    size = global_batch_size or num_samples
    if num_samples % size:
        raise ValueError(
            f"the rollout has {num_samples} samples, not a multiple of --global-batch-size {size} "
            "(rollout-batch-size × n-samples-per-prompt must be divisible by it)"
        )
    return [list(range(start, start + size)) for start in range(0, num_samples, size)]


def balanced_shares(indices: Sequence[int], lengths: Sequence[int], num_shares: int) -> list[list[int]]:
    """Split `indices` into `num_shares` equal-count shares with similar token totals.

    Longest first, each to the share with the fewest tokens that still has room (LPT); ties go
    to the lower share. Equal counts keep a step's per-rank micro-batch counts equal when batches
    are not dynamic. Each share keeps rollout order.
    """
    if len(indices) % num_shares:
        raise ValueError(
            f"{len(indices)} samples cannot be split evenly over {num_shares} data-parallel ranks"
        )
    per_share = len(indices) // num_shares
    order = sorted(indices, key=lambda i: (-lengths[i], i))
    heap = [(0, share) for share in range(num_shares)]
    shares: list[list[int]] = [[] for _ in range(num_shares)]
    for i in order:
        full = []
        while True:
            tokens, share = heapq.heappop(heap)
            if len(shares[share]) < per_share:
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


def split_to_count(batches: list[list[int]], count: int) -> list[list[int]]:
    """Split the largest micro-batches until there are `count` of them.

    Ranks hold equal numbers of samples (see `balanced_shares`) and every micro-batch holds at
    least one, so `count` (the largest count over ranks) never exceeds this rank's samples.
    """
    out = [list(b) for b in batches]
    while len(out) < count:
        largest = max(range(len(out)), key=lambda k: len(out[k]))
        if len(out[largest]) < 2:
            raise ValueError(f"cannot split {sum(map(len, out))} samples into {count} micro-batches")
        b = out.pop(largest)
        half = len(b) // 2
        out[largest:largest] = [b[:half], b[half:]]
    return out


def step_shares(lengths: Sequence[int], global_batch: int, dp_size: int) -> list[list[list[int]]]:
    """For each optimizer step, every data-parallel rank's sample positions (`balanced_shares` of
    the step). The rollout manager splits a rollout with it and every rank plans with it, so the
    part a rank receives is the part it would have picked from the whole rollout."""
    return [balanced_shares(step, lengths, dp_size) for step in split_steps(len(lengths), global_batch)]
