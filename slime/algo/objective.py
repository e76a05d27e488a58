"""The train objective: one micro-batch's loss and metric sums from the pieces in `losses`.

loss = pg_loss - entropy_coef * entropy + kl_loss_coef * kl_loss        (policy_loss)
loss = nll                                                              (sft_loss)

Every term is a weighted sum over response tokens with the global-batch weights of
`losses.token_weights`, so the per-micro-batch values add up (over micro-batches and
data-parallel ranks) to the reductions over the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slime.algo import losses
from slime.algo.plugins import LossHooks, Ragged, custom_tis, reduce_pg_loss, row_scale
from slime.config.loss import LOSS_TYPES, LossConfig

__all__ = ["LOSS_TYPES", "LossConfig", "MicroBatchTerms", "micro_batch_loss"]


@dataclass
class MicroBatchTerms:
    """Inputs of one micro-batch, response tokens only, each [batch, response_len]."""

    log_probs: torch.Tensor
    mask: torch.Tensor
    weights: torch.Tensor
    old_log_probs: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    ref_log_probs: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    ragged: Ragged | None = None
    """Each sample's response and total length: slime's loss hooks take per-sample tensors."""
    normaliser: float = 1.0
    """The step's sample count (its token count with --calculate-per-token-loss): the divisor of
    a custom pg-loss reducer's sums."""


def micro_batch_loss(
    cfg: LossConfig, t: MicroBatchTerms, hooks: LossHooks | None = None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's share of the loss and of every metric (detached sums).

    Returns:
        (loss to backpropagate, {metric name: weighted sum}); metric sums over micro-batches
        and ranks give the batch-level value of that metric.
    """
    w = t.weights
    metrics: dict[str, torch.Tensor] = {}
    if cfg.loss_type == "sft_loss":
        loss = losses.weighted_sum(losses.sft_loss(t.log_probs), w)
        metrics["loss"] = loss.detach()
        return loss, metrics

    assert t.old_log_probs is not None and t.advantages is not None
    ppo_kl = t.old_log_probs.float() - t.log_probs.float()
    if cfg.advantage_estimator == "gspo":
        ppo_kl = losses.sequence_mean_kl(ppo_kl, t.mask)
    pg_tokens, clipfrac = losses.ppo_policy_loss(
        ppo_kl, t.advantages, cfg.eps_clip, cfg.clip_high, cfg.eps_clip_c
    )
    kept_mask: torch.Tensor | None = None  # the TIS hook's masks (slime's rejection sampling)
    if cfg.use_tis:
        assert t.rollout_log_probs is not None
        # slime reports the TIS metrics over the masks given, before any rejection.
        metrics["ois"] = losses.weighted_sum(torch.exp(-ppo_kl), w).detach()
        if hooks is not None and hooks.tis is not None:
            assert t.ragged is not None
            pg_tokens, kept_mask, tis_metrics = custom_tis(
                hooks, t.ragged, pg_tokens, t.old_log_probs, t.rollout_log_probs, t.mask
            )
            for name, value in tis_metrics.items():
                metrics[name] = losses.weighted_sum(value, w).detach()
            # As slime, every term from here on drops the rejected tokens but keeps each sample's
            # normaliser (that of the masks given).
            w = kept_mask * row_scale(w, t.mask)
        else:
            tis, tis_clipped = losses.tis_weights(
                t.old_log_probs, t.rollout_log_probs, cfg.tis_clip, cfg.tis_clip_low
            )
            pg_tokens = pg_tokens * tis
            # slime's tis metrics report the ratio before the clamp.
            ratio = torch.exp(t.old_log_probs.float() - t.rollout_log_probs.float())
            metrics["tis"] = losses.weighted_sum(ratio, w).detach()
            metrics["tis_abs"] = losses.weighted_sum((ratio - 1).abs(), w).detach()
            metrics["tis_clipfrac"] = losses.weighted_sum(tis_clipped, w).detach()
    if hooks is not None and hooks.pg_loss_reducer is not None:
        assert t.ragged is not None
        pg_loss = reduce_pg_loss(
            hooks, t.ragged, pg_tokens, t.mask if kept_mask is None else kept_mask,
            cfg.calculate_per_token_loss, t.normaliser, given=kept_mask is None,
        )  # fmt: skip
    else:
        pg_loss = losses.weighted_sum(pg_tokens, w)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss.detach()
    metrics["pg_clipfrac"] = losses.weighted_sum(clipfrac, w).detach()
    metrics["ppo_kl"] = losses.weighted_sum(ppo_kl, w).detach()
    if t.entropy is not None:
        entropy = losses.weighted_sum(t.entropy, w)
        metrics["entropy"] = entropy.detach()
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * entropy
    if cfg.use_kl_loss:
        assert t.ref_log_probs is not None
        kl_loss = losses.weighted_sum(losses.approx_kl(t.log_probs, t.ref_log_probs, cfg.kl_loss_type), w)
        metrics["kl_loss"] = kl_loss.detach()
        loss = loss + cfg.kl_loss_coef * kl_loss
    metrics["loss"] = loss.detach()
    return loss, metrics
