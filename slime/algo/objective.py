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
from slime.algo.advantages import ESTIMATORS

LOSS_TYPES = ("policy_loss", "sft_loss")


@dataclass(frozen=True)
class LossConfig:
    """What the train step optimises (slime's flag names in parentheses)."""

    loss_type: str = "policy_loss"
    """`--loss-type`: policy_loss (PPO-style RL) or sft_loss (negative log-likelihood)."""
    advantage_estimator: str = "grpo"
    """`--advantage-estimator`: grpo, gspo, reinforce_plus_plus, reinforce_plus_plus_baseline, rloo."""
    disable_grpo_std_normalization: bool = False
    """`--disable-grpo-std-normalization`: GRPO/GSPO subtract the group mean only."""
    normalize_advantages: bool = False
    """`--normalize-advantages`: whiten advantages over every response token of the rollout."""
    eps_clip: float = 0.2
    """`--eps-clip`: lower clip range, ratio >= 1 - eps_clip."""
    eps_clip_high: float | None = None
    """`--eps-clip-high`: upper clip range (default: eps_clip)."""
    eps_clip_c: float | None = None
    """`--eps-clip-c`: dual-clip bound (> 1) for negative advantages; off when None."""
    use_kl_loss: bool = False
    """`--use-kl-loss`: add kl_loss_coef * KL(actor || reference) to the loss."""
    kl_loss_coef: float = 0.0
    """`--kl-loss-coef`."""
    kl_loss_type: str = "k1"
    """`--kl-loss-type`: k1, k2, k3, low_var_kl."""
    kl_coef: float = 0.0
    """`--kl-coef`: KL penalty folded into REINFORCE++ token rewards."""
    gamma: float = 1.0
    """`--gamma`: discount of REINFORCE++ returns."""
    entropy_coef: float = 0.0
    """`--entropy-coef`: subtract entropy_coef * entropy from the loss."""
    use_tis: bool = False
    """`--use-tis`: truncated importance sampling against the engine's log-probs."""
    tis_clip: float = 2.0
    """`--tis-clip`: upper bound of the TIS weight."""
    tis_clip_low: float = 0.0
    """`--tis-clip-low`: lower bound of the TIS weight."""
    calculate_per_token_loss: bool = False
    """`--calculate-per-token-loss`: average over tokens of the batch instead of per sample."""

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"--loss-type {self.loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
        if self.advantage_estimator not in ESTIMATORS:
            raise ValueError(
                f"--advantage-estimator {self.advantage_estimator!r} is not one of {', '.join(ESTIMATORS)}"
            )
        if self.kl_loss_type not in losses.KL_TYPES:
            raise ValueError(
                f"--kl-loss-type {self.kl_loss_type!r} is not one of {', '.join(losses.KL_TYPES)}"
            )
        if not 0 < self.eps_clip < 1:
            raise ValueError(f"--eps-clip must be in (0, 1), got {self.eps_clip}")
        if self.eps_clip_high is not None and self.eps_clip_high <= 0:
            raise ValueError(f"--eps-clip-high must be > 0, got {self.eps_clip_high}")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1:
            raise ValueError(f"--eps-clip-c must be > 1, got {self.eps_clip_c}")
        if self.use_tis and not 0 <= self.tis_clip_low < self.tis_clip:
            raise ValueError(
                f"--tis-clip-low ({self.tis_clip_low}) must be >= 0 and below --tis-clip ({self.tis_clip})"
            )

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def needs_ref(self) -> bool:
        """Whether reference log-probs must be computed."""
        uses_kl_reward = self.advantage_estimator.startswith("reinforce_plus_plus") and self.kl_coef != 0
        return self.loss_type == "policy_loss" and (self.use_kl_loss or uses_kl_reward)

    @property
    def needs_rollout_log_probs(self) -> bool:
        return self.loss_type == "policy_loss" and self.use_tis


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


def micro_batch_loss(cfg: LossConfig, t: MicroBatchTerms) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
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
    if cfg.use_tis:
        assert t.rollout_log_probs is not None
        tis, tis_clipped = losses.tis_weights(
            t.old_log_probs, t.rollout_log_probs, cfg.tis_clip, cfg.tis_clip_low
        )
        pg_tokens = pg_tokens * tis
        metrics["tis"] = losses.weighted_sum(tis, w).detach()
        metrics["tis_clipfrac"] = losses.weighted_sum(tis_clipped, w).detach()
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
