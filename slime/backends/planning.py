"""A train rank's plan of a rollout: its micro-batches for each optimizer step.

Every rank plans every rank's share of the whole rollout (slime.utils.step_plans), so the ranks
agree on the number of steps and of micro-batches without talking; a rank then keeps its own,
as positions in the part of the rollout it was given.
"""

from __future__ import annotations

from typing import Any, Protocol

from slime.config.train import TrainConfig
from slime.utils import step_plans
from slime.utils.model_families import packable
from slime.utils.rollout_batch import BatchError, RolloutBatch, RolloutPart
from slime.utils.step_plans import StepPlan


class Place(Protocol):
    """Where a rank sits in the data-parallel layout (a backend, or a test's stand-in)."""

    dp_rank: int
    dp_size: int
    context_parallel: int


def packs_sequences(cfg: TrainConfig, hf_config: Any) -> bool:
    """Whether micro-batches are packed (one row, no padding; token budgets count real tokens):
    both backends pack unless --padded-micro-batches asks for the padded layout or the backend
    cannot keep the model's packed samples apart (slime.utils.model_families)."""
    model_type = getattr(hf_config, "model_type", None)  # None: planning only
    return not cfg.batch.padded_micro_batches and packable(model_type, cfg.backend)


def plan(
    cfg: TrainConfig,
    place: Place,
    data: RolloutBatch | RolloutPart,
    hf_config: Any = None,
    max_tokens: int | None = None,
) -> list[StepPlan]:
    """This rank's micro-batches per optimizer step, as positions in the part's batch
    (`max_tokens`: another token budget than --max-tokens-per-gpu)."""
    part = RolloutPart.of(data)
    b = cfg.batch
    lengths = part.lengths
    global_batch = b.global_batch_for(part.num_executions)
    b.check_layout(place.dp_size, global_batch)
    if part.dp_size is not None and part.dp_size != place.dp_size:
        raise BatchError(
            f"the rollout was split for {part.dp_size} data-parallel replicas, but this job trains on "
            f"{place.dp_size}; the rollout manager and the train ranks disagree on the layout"
        )
    local, plans = {g: k for k, g in enumerate(part.positions)}, []
    flops = step_plans.flops_coefficient(hf_config) if b.balance_by_flops else None
    packed = packs_sequences(cfg, hf_config)
    for step, shares in zip(
        step_plans.split_steps(part.num_samples, global_batch, part.executions),
        step_plans.step_shares(lengths, global_batch, place.dp_size, part.executions),
    ):
        if b.use_dynamic_batch_size:
            budget = max_tokens or b.max_tokens_per_gpu
            assert budget is not None
            budget *= place.context_parallel  # slime's rule: each GPU holds 1 / CP of a micro-batch
            per_rank = [
                step_plans.pack_micro_batches(s, lengths, budget, packed)
                if flops is None
                else step_plans.flops_micro_batches(s, lengths, budget, flops)
                for s in shares
            ]
        else:
            per_rank = [step_plans.fixed_micro_batches(s, b.micro_batch_size) for s in shares]
        per_rank, merged = step_plans.rank_micro_batches(per_rank, shares, lengths)
        if merged and place.dp_rank == 0 and not max_tokens:
            step_plans.warn_merged(len(step), place.dp_size, b.use_dynamic_batch_size)
        mine = per_rank[place.dp_rank]
        missing = [g for mb in mine for g in mb if g not in local]
        if missing:
            raise BatchError(
                f"data-parallel rank {place.dp_rank} was given a part without sample(s) {missing[:5]} of "
                "its share: the rollout was split by another rule or for another layout"
            )
        num_tokens = sum(part.loss_tokens[g] for g in step)
        norms = step_plans.execution_normalisers(step, part.loss_tokens, part.executions, local)
        plans.append(StepPlan([[local[g] for g in mb] for mb in mine], len(step), int(num_tokens), *norms))
    return plans


def log_prob_plans(
    cfg: TrainConfig,
    place: Place,
    data: RolloutBatch | RolloutPart,
    train_plans: list[StepPlan],
    hf_config: Any = None,
) -> list[StepPlan]:
    """The log-prob passes' micro-batches: the training steps' unless --log-probs-max-tokens-per-gpu
    sets another budget. The same micro-batches as training (same padding, same kernels) make the
    first step's ppo_kl exactly 0; a separate budget trades that for memory."""
    budget = cfg.batch.log_probs_max_tokens_per_gpu
    if budget is None or not cfg.batch.use_dynamic_batch_size or budget == cfg.batch.max_tokens_per_gpu:
        return train_plans
    return plan(cfg, place, data, hf_config, max_tokens=budget)


def positions(plans: list[StepPlan]) -> list[int]:
    """Every position the plans train on, in order."""
    return [p for step in plans for mb in step.micro_batches for p in mb]
