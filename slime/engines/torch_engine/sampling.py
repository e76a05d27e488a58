"""Batched token sampling with per-request temperature, top-k, top-p, min-p and seeds.

Log-probs are taken from log_softmax(logits / temperature) *before* any truncation (for
temperature 0 the plain log_softmax): that is the distribution the trainer recomputes, so
trainer and engine log-probs agree even when top-p / top-k shape what is sampled.
Sampling uses the exponential-race form argmax(p / E) with E ~ Exp(1), which equals drawing from
p and lets each seeded request draw its noise from its own generator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from slime.utils import transfer
from slime.utils.sampling_params import SamplingParams


@dataclass
class SampleOutput:
    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[float, int]]] | None


@dataclass(frozen=True)
class BatchSampling:
    """A batch's sampling settings, turned into what the device needs once per batch: a decode
    round (slime.engines.torch_engine.rounds) samples every one of its steps with one of these,
    so the host's per-row work is done once per round, not once per step."""

    generators: list[torch.Generator | None]
    """Per row, a seeded request's own generator (None: the engine's)."""
    temperatures: torch.Tensor
    """[B, 1] on the device: each row's temperature (1 for greedy rows, whose log-probs are plain)."""
    sampled: list[int]
    """The rows that sample (the others take the argmax)."""
    sampled_index: torch.Tensor | None
    """`sampled` on the device (None: every row samples, or none)."""
    limits: torch.Tensor | None
    """[len(sampled), 3] float64 on the device: top-k (infinite for none), top-p, min-p of the
    sampled rows, where any truncates (None: none does)."""
    num_unseeded: int
    """How many of the `sampled` rows draw from the engine's generator."""
    unseeded_index: torch.Tensor | None
    """Their positions in `sampled`, on the device (None: all of them, or none)."""
    never: torch.Tensor | None
    """Token ids never picked (a vision-language model's image placeholders), on the device."""

    @classmethod
    def of(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        device: torch.device,
        never: list[int] | None = None,
    ) -> BatchSampling:
        temps = torch.tensor([[p.temperature if p.temperature > 0 else 1.0] for p in params])
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        partial = 0 < len(sampled) < len(params)
        limits = None
        if any(params[i].needs_truncation for i in sampled):
            rows = [params[i] for i in sampled]
            limits = transfer.to_device(_limits(rows), device)
        unseeded = [j for j, i in enumerate(sampled) if generators[i] is None]
        return cls(
            generators,
            transfer.to_device(temps, device),
            sampled,
            transfer.to_device(torch.tensor(sampled), device) if partial else None,
            limits,
            len(unseeded),
            transfer.to_device(torch.tensor(unseeded), device) if 0 < len(unseeded) < len(sampled) else None,
            transfer.to_device(torch.tensor(never), device) if never else None,
        )


def truncate_probs(probs_BV: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the probabilities that top-k / top-p / min-p exclude, row by row (no renormalising)."""
    return _truncate(probs_BV, transfer.to_device(_limits(params), probs_BV.device))


def _limits(params: list[SamplingParams]) -> torch.Tensor:
    """[rows, 3] float64: top-k (infinite for none), top-p, min-p."""
    return torch.tensor(
        [[p.top_k if p.top_k > 0 else math.inf, p.top_p, p.min_p] for p in params], dtype=torch.float64
    )


def _truncate(probs_BV: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    device = probs_BV.device
    top_k, top_p, min_p = limits[:, 0], limits[:, 1].to(probs_BV.dtype), limits[:, 2].to(probs_BV.dtype)
    sorted_probs, order = probs_BV.sort(dim=-1, descending=True)
    ranks = torch.arange(probs_BV.shape[-1], device=device)[None, :]
    # Keep a token if the mass strictly before it is below top_p: the top token always stays.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = (ranks < top_k[:, None]) & (mass_before < top_p[:, None])
    keep_sorted &= sorted_probs >= (min_p[:, None] * sorted_probs[:, :1])
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    return probs_BV.masked_fill(~keep, 0.0)


def sample(
    logits_BV: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator | None,
    top_logprobs_nums: list[int] | None = None,
    never: list[int] | None = None,
) -> SampleOutput:
    """Pick one token per row and bring the tokens and their log-probs to the host.

    Args:
        logits_BV: float32 logits of the last position of each sequence.
        params: one SamplingParams per row.
        generators: per-row generator for seeded requests (None: use `default_generator`).
        top_logprobs_nums: per row, how many most likely (logprob, token) pairs to return
            (0: none, and that row costs no top-k).
        never: token ids never picked (a vision-language model's image placeholders); like top-k's
            truncation, this shapes what is sampled, not the reported log-probs.
    """
    batch = BatchSampling.of(params, generators, logits_BV.device, never)
    tokens_B, chosen_B, logprobs_BV = sample_on_device(logits_BV, batch, default_generator)
    host = transfer.to_host(pack(tokens_B, chosen_B))
    tokens, logprobs = unpack(host)
    return SampleOutput(tokens, logprobs, _top_logprobs(logprobs_BV, top_logprobs_nums))


def sample_on_device(
    logits_BV: torch.Tensor, batch: BatchSampling, default_generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`sample` without the copy down: token ids [B] (int64), their log-probs [B] and the
    log-probs of every token [B, V], all where the logits are."""
    logits_BV = logits_BV.float()
    logprobs_BV = torch.log_softmax(logits_BV / batch.temperatures, dim=-1)
    allowed_BV = logprobs_BV
    if batch.never is not None:
        allowed_BV = logprobs_BV.index_fill(1, batch.never, float("-inf"))
    tokens_B = allowed_BV.argmax(dim=-1)
    if batch.sampled:
        rows = batch.sampled_index
        probs = (allowed_BV if rows is None else allowed_BV.index_select(0, rows)).exp()
        if batch.limits is not None:
            probs = _truncate(probs, batch.limits)
        noise = torch.empty_like(probs)
        if batch.num_unseeded == len(batch.sampled):
            noise.exponential_(generator=default_generator)
        elif batch.unseeded_index is not None:
            draws = torch.empty((batch.num_unseeded, probs.shape[-1]), device=probs.device, dtype=probs.dtype)
            noise.index_copy_(0, batch.unseeded_index, draws.exponential_(generator=default_generator))
        for j, i in enumerate(batch.sampled):
            gen = batch.generators[i]
            if gen is not None:
                noise[j].exponential_(generator=gen)
        picked = (probs / noise).argmax(dim=-1)
        tokens_B = picked if rows is None else tokens_B.index_copy(0, rows, picked)
    chosen_B = logprobs_BV.gather(1, tokens_B[:, None])[:, 0]
    return tokens_B, chosen_B, logprobs_BV


def pack(tokens_B: torch.Tensor, chosen_B: torch.Tensor) -> torch.Tensor:
    """Token ids and their log-probs (any equal shapes) stacked, for one copy down (float64 holds
    both exactly: ids below 2**53, float32 log-probs)."""
    return torch.stack((tokens_B.to(torch.float64), chosen_B.to(torch.float64)))


def unpack(host: torch.Tensor) -> tuple[list[int], list[float]]:
    return [int(t) for t in host[0].tolist()], host[1].tolist()


def _top_logprobs(logprobs_BV: torch.Tensor, nums: list[int] | None) -> list[list[tuple[float, int]]] | None:
    """Top-k (logprob, token) pairs, computed only for the rows that ask (others get [])."""
    if not nums or not any(n > 0 for n in nums):
        return None
    rows = [i for i, n in enumerate(nums) if n > 0]
    k = min(max(nums), logprobs_BV.shape[-1])
    index = transfer.to_device(torch.tensor(rows), logprobs_BV.device)
    values, ids = logprobs_BV.index_select(0, index).topk(k, dim=-1)
    top: list[list[tuple[float, int]]] = [[] for _ in nums]
    both = transfer.to_host(torch.stack((values.to(torch.float64), ids.to(torch.float64))))
    for row, v, t in zip(rows, both[0].tolist(), both[1].long().tolist()):
        top[row] = list(zip(v, t))[: nums[row]]
    return top
