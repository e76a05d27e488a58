"""Policy, KL, entropy and SFT losses: pure tensor math, no distributed code.

Every function works on response tokens laid out as [batch, response_len] with a 0/1 mask
(padding and tokens excluded from the loss are 0). Reductions are weighted sums: the train
actor builds one weight per token (`token_weights`) from the *global* batch, so that a
data-parallel rank summing its share of `values * weights` and the all-reduce of those sums
give exactly the single-process loss.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slime.config.loss import KL_TYPES


def approx_kl(
    log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kl_type: str, ratio: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token estimate of KL(actor || reference), with d = log p - log p_ref.

    - k1:  d
    - k2:  d^2 / 2
    - k3:  exp(-d) - 1 + d            (unbiased, non-negative)
    - low_var_kl: k3 with d clamped to [-20, 20] and the result clamped to [-10, 10]

    `ratio` (--use-unbiased-kl): each token's estimate times p / p_old, which makes it unbiased
    for samples drawn from the old policy (DeepSeek-V3.2's estimator); the gradient flows
    through the ratio, and low_var_kl's clamp comes after the product, as in slime.

    All four are exactly 0 where the two log-probs are equal.
    """
    d = log_probs.float() - ref_log_probs.float()
    if kl_type == "k1":
        kl = d
    elif kl_type == "k2":
        kl = 0.5 * d * d
    elif kl_type in ("k3", "low_var_kl"):
        if kl_type == "low_var_kl":
            d = d.clamp(-20.0, 20.0)
        kl = torch.exp(-d) - 1.0 + d
    else:
        raise ValueError(f"unknown --kl-loss-type {kl_type!r}; choose one of {', '.join(KL_TYPES)}")
    if ratio is not None:
        kl = ratio * kl
    return kl.clamp(-10.0, 10.0) if kl_type == "low_var_kl" else kl


def sequence_mean_kl(ppo_kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's sequence-level log-ratio: every token gets its sequence's masked mean of ppo_kl."""
    mask_f = mask.to(ppo_kl.dtype)
    per_seq = (ppo_kl * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1.0)
    return per_seq.unsqueeze(-1).expand_as(ppo_kl)


def ppo_policy_loss(
    ppo_kl: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float,
    eps_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Clipped surrogate loss per token.

    With ratio rho = exp(-ppo_kl) = p_new / p_old and advantage A:

        L = max(-rho A, -clip(rho, 1 - eps_clip, 1 + eps_clip_high) A)

    Dual clip (`eps_clip_c` = c > 1, Ye et al. 2020): for A < 0 the loss is additionally bounded
    by -c A, i.e. L = min(L, -c A).

    Returns:
        (loss per token, clipfrac per token): clipfrac is 1 where the clipped term was chosen.
    """
    ratio = torch.exp(-ppo_kl)
    loss_unclipped = -ratio * advantages
    loss_clipped = -ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipfrac = (loss_clipped > loss_unclipped).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"--eps-clip-c must be > 1 (got {eps_clip_c})")
        bound = -eps_clip_c * advantages
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return loss, clipfrac


def tis_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, clip_high: float, clip_low: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling between the trainer's and the engine's policies.

    w = clamp(exp(log p_trainer_old - log p_engine), clip_low, clip_high). The policy loss is
    multiplied by w (no gradient flows through w).

    Returns:
        (weights, clipped): clipped is 1 where the clamp changed the weight.
    """
    raw = torch.exp(old_log_probs.float() - rollout_log_probs.float())
    weights = raw.clamp(min=clip_low, max=clip_high)
    return weights.detach(), (weights != raw).float()


def icepop_weights(
    old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, clip_high: float, clip_low: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """IcePop-style token masking between the trainer's and the engine's policies.

    With r = exp(log p_trainer_old - log p_engine): w = r where clip_low <= r <= clip_high, else 0.
    Unlike `tis_weights`, a token outside the band is dropped from the policy loss instead of
    clamped to the band's edge (no gradient flows through w).

    Returns:
        (weights, dropped): dropped is 1 where w differs from r (the token left the loss).
    """
    raw = torch.exp(old_log_probs.float() - rollout_log_probs.float())
    weights = torch.where((raw >= clip_low) & (raw <= clip_high), raw, torch.zeros_like(raw))
    return weights.detach(), (weights != raw).float()


def opsm_keep(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    delta: float,
) -> torch.Tensor:
    """Off-policy sequence masking (OPSM): which tokens keep their policy loss.

    Per sample i, the mean log-ratio over its loss tokens

        kl_i = sum_t m_it (log p_old,it - log p_it) / max(sum_t m_it, 1)

    and keep_it = 0 where A_it < 0 and kl_i > delta, else 1: a sample whose policy has moved more
    than delta away from p_old (the ratio's old policy) stops pushing its negative-advantage
    tokens down. The policy loss is multiplied by keep (no gradient flows through it).

    Returns:
        keep, laid out like `log_probs` ([batch, response_len], one sample per row).
    """
    mask_f = mask.float()
    diff = old_log_probs.float() - log_probs.detach().float()
    seq_kl = (diff * mask_f).sum(-1, keepdim=True) / mask_f.sum(-1, keepdim=True).clamp(min=1.0)
    dropped = (advantages < 0) & (seq_kl > delta)
    return (~dropped).float()


def behaviour_weights(
    proximal_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, cap: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoupled objective's behaviour importance weight (AReaL's decoupled PPO).

    w = exp(log p_proximal - log p_behaviour), with the proximal policy the trainer's log-probs
    recomputed before the rollout's first optimizer step and the behaviour policy the engine's
    (per token, possibly from several weight versions). Tokens with w > cap are masked (w = 0), not clamped
    to cap as `tis_weights` does; without a cap nothing is masked. No gradient flows through w.

    Returns:
        (weights, masked): masked is 1 where w > cap.
    """
    raw = torch.exp(proximal_log_probs.float() - rollout_log_probs.float())
    if cap is None:
        return raw.detach(), torch.zeros_like(raw)
    masked = raw > cap
    return torch.where(masked, torch.zeros_like(raw), raw).detach(), masked.float()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v over the last dimension (logits already divided by temperature)."""
    return entropy_from_log_probs(torch.log_softmax(logits.float(), dim=-1))


def entropy_from_log_probs(log_p: torch.Tensor) -> torch.Tensor:
    """H = -sum_v p_v log p_v from log-probabilities over the last dimension."""
    return -(log_p.exp() * log_p).sum(-1)


def sft_loss(log_probs: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood per token: -log p(token)."""
    return -log_probs


def token_weights(
    masks: torch.Tensor,
    per_token: bool,
    num_samples_global: int,
    num_tokens_global: int,
    denominators: Sequence[int] | None = None,
) -> torch.Tensor:
    """Weights w such that sum(values * w) is the loss reduction over the global batch.

    - per-sample (default): mean over each sample's masked tokens, then mean over samples:
      w_it = m_it / (sum_t m_it * num_samples_global).
    - per-token (`--calculate-per-token-loss`): mean over every masked token of the batch:
      w_it = m_it / num_tokens_global.

    `denominators` (per row): an execution split into several samples counts once, as slime's
    `rollout_mask_sums`: each row's sum_t m_it is replaced by its whole execution's masked
    tokens, and `num_samples_global` counts executions.
    """
    mask_f = masks.float()
    if per_token:
        return mask_f / max(num_tokens_global, 1)
    if denominators is None:
        lengths = mask_f.sum(-1, keepdim=True).clamp(min=1.0)
    else:
        lengths = torch.tensor(denominators, dtype=mask_f.dtype).unsqueeze(-1).clamp(min=1.0)
    return mask_f / (lengths * max(num_samples_global, 1))


def weighted_sum(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum(values * weights): the reduction every loss and metric goes through."""
    return (values.float() * weights).sum()


def value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The critic's clipped value loss per token, as slime's (no 1/2 factor):

        V_clip = V_old + clamp(V - V_old, -clip, clip)
        L      = max((V - R)^2, (V_clip - R)^2)

    Returns:
        (loss per token, clipfrac per token): clipfrac is 1 where |V - V_old| > clip.
    """
    v, old, r = values.float(), old_values.float(), returns.float()
    clipped = old + (v - old).clamp(-clip, clip)
    loss = torch.maximum((v - r) ** 2, (clipped - r) ** 2)
    return loss, ((v - old).abs() > clip).float()
