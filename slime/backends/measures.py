"""What a train rank measures and records about a rollout, beside training on it: the
trainer's token means (`rollout/*` metrics), --check-precision's measurements and the
--save-debug-train-data rows; and the reductions over the ranks they need."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from slime.algo.losses import approx_kl, token_weights
from slime.backends.interface import PerPosition
from slime.backends.micro_batch import MicroBatch
from slime.config.lora import dump_record
from slime.config.train import TrainConfig
from slime.utils.rollout_batch import BatchError, RolloutBatch, RolloutPart
from slime.utils.step_plans import StepPlan
from slime.utils.transfer import to_device


class DeviceMax:
    """The largest |a - b| over masked positions seen so far, kept where the values are (no wait
    for the device per micro-batch); a NaN stays (a NaN gap must reach --check-precision's gate).
    `value` reads it on the host: 0 when nothing was masked in."""

    def __init__(self) -> None:
        self.top: torch.Tensor | None = None

    def add(self, a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> None:
        gaps = (a.detach().double() - b.detach().double()).abs()
        top = torch.where(mask.bool(), gaps, torch.zeros_like(gaps)).max()
        self.top = top if self.top is None else torch.maximum(self.top, top)

    @property
    def value(self) -> float:
        return 0.0 if self.top is None else float(self.top)


@dataclass
class TokenValues:
    """The per-token values of a rank's samples in one train call, by position in its batch."""

    old: PerPosition | None = None
    """The old policy's log-probs (the log-prob pass's, or the engine's)."""
    ref: PerPosition | None = None
    teacher: PerPosition | None = None
    """OPD's teacher log-probs."""
    advantages: PerPosition | None = None
    returns: PerPosition | None = None
    """PPO: the critic's targets."""
    critic: dict[int, list[float]] | None = None
    """PPO: the critic's values, by sample index."""
    entropies: dict[str, PerPosition] = field(default_factory=dict)
    """--use-rollout-entropy: the log-prob passes' entropy (and ref_entropy), by name."""


def step_weights(mb: MicroBatch, step: StepPlan, per_token: bool, device: torch.device) -> torch.Tensor:
    """The loss weights of `mb`'s tokens in optimizer step `step` (slime.algo.losses.token_weights;
    `per_token`: --calculate-per-token-loss), on `device`."""
    weights = token_weights(
        mb.loss_mask, per_token, step.num_executions, step.num_tokens, step.row_denominators(mb.positions)
    )
    return to_device(weights, device)


def add_to(sums: dict[str, torch.Tensor], name: str, value: torch.Tensor) -> None:
    """`sums[name] += value` in float64 where `value` is: a micro-batch's metric never waits for
    the device (a copy to the host would, before its backward pass is even launched);
    `sum_over_ranks` brings the step's sums down once."""
    value = value.detach().double()
    sums[name] = sums[name] + value if name in sums else value.clone()  # (never the caller's storage)


def sum_over_ranks(sums: dict[str, torch.Tensor], contribute: bool = True) -> dict[str, float]:
    """A step's metric sums over every rank (one that does not `contribute` adds zeros). The
    names are gathered first: a TIS hook may report metrics the loss config does not name,
    and a rank without the loss (a Megatron pipeline stage) computes none."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, sorted(sums) if contribute else [])
    names = sorted(set().union(*gathered))
    zero = torch.zeros((), dtype=torch.float64)
    values = [sums[n].double().cpu() if contribute and n in sums else zero for n in names]
    reduced = torch.stack(values) if names else torch.zeros(0, dtype=torch.float64)
    dist.all_reduce(reduced)
    return {n: float(v) for n, v in zip(names, reduced)}


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def save_train_data(
    cfg: TrainConfig,
    place: tuple[int, int],
    rollout_id: int,
    part: RolloutPart,
    mine: list[int],
    v: TokenValues,
) -> None:
    """--save-debug-train-data: this rank's samples as it trains on them, each keyed by its
    `sample_index` (the sample's index in the rollout dump), so the two files join. PPO adds
    the critic's `values` and the `returns`, OPD the `teacher_log_probs` (slime's names). `place`:
    (data-parallel rank, size); one rank of each replica writes."""
    from slime.rollout.dump import TRAIN_FORMAT_VERSION, write_atomic

    def values(d: dict[int, torch.Tensor] | None, p: int) -> list[float] | None:
        return None if d is None else d[p].tolist()

    batch = part.batch
    index = batch.sample_indices or part.positions
    rows = [
        {
            "sample_index": index[p],
            "tokens": list(batch.tokens[p]),
            "response_length": batch.response_lengths[p],
            "loss_mask": loss_mask(batch, p).int().tolist(),
            "reward": float(batch.rewards[p]),
            "log_probs": values(v.old, p),
            "ref_log_probs": values(v.ref, p),
            "rollout_log_probs": None
            if batch.rollout_log_probs is None
            else list(batch.rollout_log_probs[p]),
            "advantages": values(v.advantages, p),
            **(
                {"values": list(v.critic[index[p]]), "returns": values(v.returns, p)}
                if v.critic is not None
                else {}
            ),
            **({"teacher_log_probs": values(v.teacher, p)} if v.teacher is not None else {}),
        }
        for p in mine
    ]
    assert cfg.save_debug_train_data is not None
    payload = {
        "format_version": TRAIN_FORMAT_VERSION,
        "rollout_id": rollout_id,
        "rank": place[0],
        "world_size": place[1],
        "samples": rows,
        "lora": dump_record(cfg.lora),
    }
    write_atomic(cfg.save_debug_train_data.format(rollout_id=rollout_id, rank=place[0]), payload)


def loss_mask(batch: RolloutBatch, p: int) -> torch.Tensor:
    if batch.loss_masks is not None:
        return torch.tensor(batch.loss_masks[p], dtype=torch.float32)
    return torch.ones(batch.response_lengths[p])


def rollout_metrics(
    cfg: TrainConfig, batch: RolloutBatch, mine: list[int], v: TokenValues, group: Any
) -> dict[str, float]:
    """Token means over the loss mask, over all ranks: the trainer's log-probs, the
    reference's, the OPD teacher's and the engine's, the KL to the reference and to the
    teacher (slime's opd_reverse_kl), the trainer-engine gap, and `entropies` by name
    (--use-rollout-entropy: the log-prob passes' entropy and ref_entropy); `group`: the
    data-parallel group."""
    old, ref, teacher = v.old, v.ref, v.teacher
    assert old is not None
    names = ["log_probs", *v.entropies]
    if ref is not None:
        names += ["ref_log_probs", "kl"]
    if teacher is not None:
        names += ["teacher_log_probs", "opd_reverse_kl"]
    if batch.rollout_log_probs is not None:
        names += ["rollout_log_probs", "train_rollout_logprob_abs_diff"]
    sums = torch.zeros(len(names) + 1, dtype=torch.float64)  # ..., number of tokens
    worst = torch.zeros(1, dtype=torch.float64)
    for p in mine:
        mask = loss_mask(batch, p).bool()
        values = {"log_probs": old[p], **{name: e[p] for name, e in v.entropies.items()}}
        if ref is not None:
            values["ref_log_probs"] = ref[p]
            values["kl"] = approx_kl(old[p], ref[p], cfg.loss.kl_loss_type)
        if teacher is not None:
            values["teacher_log_probs"] = teacher[p]
            values["opd_reverse_kl"] = old[p] - teacher[p]
        if batch.rollout_log_probs is not None:
            engine = torch.tensor(batch.rollout_log_probs[p])
            values["rollout_log_probs"] = engine
            values["train_rollout_logprob_abs_diff"] = (old[p] - engine).abs()
        if not mask.any():
            continue
        for i, name in enumerate(names):
            sums[i] += values[name][mask].double().sum()
        sums[-1] += mask.sum()
        if batch.rollout_log_probs is not None:
            worst = torch.maximum(worst, values["train_rollout_logprob_abs_diff"][mask].double().max())
    dist.all_reduce(sums, group=group)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    out = {name: float(sums[i] / sums[-1].clamp(min=1)) for i, name in enumerate(names)}
    if batch.rollout_log_probs is not None:
        out["train_rollout_logprob_abs_diff_max"] = float(worst[0])
    return out


def precision_stats(batch: RolloutBatch, mine: list[int], v: TokenValues, group: Any) -> dict[str, float]:
    """What --check-precision's gates need beyond the token means, over all ranks."""
    old, ref = v.old, v.ref
    assert old is not None
    counts = torch.zeros(2, dtype=torch.float64)  # non-finite log-probs, tokens where actor != ref
    highs = torch.full((2,), -float("inf"), dtype=torch.float64)  # max log-prob, max |actor - ref|
    for p in mine:
        mask = loss_mask(batch, p).bool()
        values = old[p][mask].double()
        counts[0] += (~torch.isfinite(values)).sum()
        if values.numel():
            highs[0] = torch.maximum(highs[0], values.max())
        if ref is not None:
            gap = (values - ref[p][mask].double()).abs()
            counts[1] += (gap != 0).sum()
            if gap.numel():
                highs[1] = torch.maximum(highs[1], gap.max())
    dist.all_reduce(counts, group=group)
    dist.all_reduce(highs, op=dist.ReduceOp.MAX, group=group)
    out = {"nonfinite": float(counts[0]), "max_log_prob": float(highs[0])}
    if ref is not None:
        worst = float(highs[1])
        out["ref_max_abs_diff"] = 0.0 if worst == -float("inf") else worst  # NaN stays NaN
        out["ref_tokens_differ"] = float(counts[1])
    return out


def uncovered(
    batch: RolloutBatch, mine: list[int], index: list[int], per_sample: dict[int, list[float]]
) -> int | None:
    """The first of this rank's positions whose per-token list (keyed by sample index) is
    missing or not one entry per response token; None when all are there."""
    return next((p for p in mine if len(per_sample.get(index[p], ())) != batch.response_lengths[p]), None)


def raise_agreed(problem: str | None) -> None:
    """BatchError on every rank with the first rank's `problem` (collective: a problem only one
    rank sees must not leave the others waiting in the next collective)."""
    everyone: list[Any] = [problem]
    if dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, problem)
    first = next((e for e in everyone if e), None)
    if first:
        raise BatchError(first)
