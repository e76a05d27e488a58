"""The train objective: one micro-batch's loss and metric sums from the pieces in `losses`.

loss = pg_loss - entropy_coef * entropy + kl_loss_coef * kl_loss        (policy_loss)
loss = nll                                                              (sft_loss)

pg_loss reduces, per token, the clipped surrogate times the off-policy corrections asked for:
the OPSM mask (--use-opsm), then one importance weight, the decoupled loss's behaviour weight
(--use-decoupled-loss) or TIS's (--use-tis, built in or slime's hook).

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
    pg_tokens = _off_policy_corrections(cfg, t, pg_tokens, metrics)
    kept_mask: torch.Tensor | None = None  # the TIS hook's masks (slime's rejection sampling)
    if cfg.use_tis or cfg.get_mismatch_metrics:  # the latter: the hook's metrics (and its loss, as slime)
        pg_tokens, kept_mask = _importance_sampling(cfg, t, hooks, pg_tokens, ppo_kl, metrics)
        if kept_mask is not None and torch.equal(kept_mask, t.mask.to(kept_mask.dtype)):
            kept_mask = None  # nothing rejected: the weights stay as given, not rescaled with rounding
        if kept_mask is not None:
            # As slime, every term from here on drops the rejected tokens but keeps each sample's
            # normaliser (that of the masks given).
            w = kept_mask * row_scale(w, t.mask)
    if hooks is not None and hooks.pg_loss_reducer is not None:
        assert t.ragged is not None
        pg_loss = reduce_pg_loss(
            hooks,
            t.ragged,
            pg_tokens,
            t.mask if kept_mask is None else kept_mask,
            cfg.calculate_per_token_loss,
            t.normaliser,
            given=kept_mask is None,
        )
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
        ratio = None
        if cfg.use_unbiased_kl:  # exp(-ppo_kl): p / p_old per token (GSPO: the sequence's ratio)
            ratio = torch.exp(-ppo_kl)
        kl = losses.approx_kl(t.log_probs, t.ref_log_probs, cfg.kl_loss_type, ratio)
        kl_loss = losses.weighted_sum(kl, w)
        metrics["kl_loss"] = kl_loss.detach()
        loss = loss + cfg.kl_loss_coef * kl_loss
    metrics["loss"] = loss.detach()
    return loss, metrics


def _off_policy_corrections(
    cfg: LossConfig, t: MicroBatchTerms, pg_tokens: torch.Tensor, metrics: dict[str, torch.Tensor]
) -> torch.Tensor:
    """--use-opsm and --use-decoupled-loss on the clipped policy loss per token; adds their
    metrics (over the loss masks given) to `metrics`."""
    assert t.old_log_probs is not None and t.advantages is not None
    if cfg.use_opsm:  # as slime: before any importance weight
        keep = losses.opsm_keep(t.log_probs, t.old_log_probs, t.advantages, t.mask, cfg.opsm_delta)
        pg_tokens = pg_tokens * keep
        metrics["opsm_clipfrac"] = losses.weighted_sum(1.0 - keep, t.weights).detach()
    if cfg.use_decoupled_loss:
        assert t.rollout_log_probs is not None
        behav, masked = losses.behaviour_weights(
            t.old_log_probs, t.rollout_log_probs, cfg.behav_imp_weight_cap
        )
        pg_tokens = pg_tokens * behav
        metrics["behav_imp_weight"] = losses.weighted_sum(behav, t.weights).detach()
        metrics["behav_mask_frac"] = losses.weighted_sum(masked, t.weights).detach()
    return pg_tokens


def _importance_sampling(
    cfg: LossConfig,
    t: MicroBatchTerms,
    hooks: LossHooks | None,
    pg_tokens: torch.Tensor,
    ppo_kl: torch.Tensor,
    metrics: dict[str, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """--use-tis: the policy loss per token weighted by the built-in TIS or the TIS hook, and the
    masks the hook returned (None for the built-in); adds the TIS metrics to `metrics`."""
    assert t.rollout_log_probs is not None and t.old_log_probs is not None
    w = t.weights
    # slime reports the TIS metrics over the masks given, before any rejection.
    metrics["ois"] = losses.weighted_sum(torch.exp(-ppo_kl), w).detach()
    if hooks is not None and hooks.tis is not None:
        assert t.ragged is not None
        pg_tokens, kept_mask, tis_metrics = custom_tis(
            hooks, t.ragged, pg_tokens, t.old_log_probs, t.rollout_log_probs, t.mask
        )
        for name, value in tis_metrics.items():
            metrics[name] = losses.weighted_sum(value, w).detach()
        return pg_tokens, kept_mask
    tis, tis_clipped = losses.tis_weights(
        t.old_log_probs, t.rollout_log_probs, cfg.tis_clip, cfg.tis_clip_low
    )
    # slime's tis metrics report the ratio before the clamp.
    ratio = torch.exp(t.old_log_probs.float() - t.rollout_log_probs.float())
    metrics["tis"] = losses.weighted_sum(ratio, w).detach()
    metrics["tis_abs"] = losses.weighted_sum((ratio - 1).abs(), w).detach()
    metrics["tis_clipfrac"] = losses.weighted_sum(tis_clipped, w).detach()
    return pg_tokens * tis, None
