"""Advantage estimators: pure tensor math, no distributed code.

Two stages, as in slime:

1. `normalize_group_rewards` turns the raw rewards of one rollout into the per-sample scalars
   the estimator needs (group mean removed; divided by the group std for GRPO/GSPO).
2. `compute_advantages` turns those scalars (and, for REINFORCE++, the per-token KL to the
   reference) into one advantage per response token.

Whitening (`--normalize-advantages`, always on for the REINFORCE++ family) needs the mean and
variance over every response token of the rollout, which a data-parallel trainer only has
after an all-reduce; `whitening_stats` gives the local sums, `whiten` applies the global ones.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from slime.config.loss import ESTIMATORS

GROUP_STD_EPS = 1e-6
WHITEN_EPS = 1e-8


def _groups(group_indices: Sequence[int]) -> dict[int, list[int]]:
    members: dict[int, list[int]] = defaultdict(list)
    for position, group in enumerate(group_indices):
        members[group].append(position)
    return members


def normalize_group_rewards(
    rewards: Sequence[float],
    group_indices: Sequence[int],
    estimator: str,
    std_normalization: bool = True,
    executions: Sequence[int] | None = None,
) -> torch.Tensor:
    """Per-sample reward scalars after the estimator's group baseline.

    With r_i the reward of sample i and G(i) its group (same prompt):

    - grpo, gspo:   (r_i - mean_G) / (std_G + 1e-6), std unbiased (n - 1); without
      std normalization (`--disable-grpo-std-normalization`) only r_i - mean_G.
    - rloo:         r_i - mean_{j in G, j != i} r_j  =  n / (n - 1) * (r_i - mean_G).
    - reinforce_plus_plus_baseline: r_i - mean_G.
    - reinforce_plus_plus, ppo: r_i unchanged (no group baseline; PPO's is the critic).

    A group of one sample has no baseline to compare with: its scalar is 0 for every estimator
    that uses a group baseline.

    `executions[i]`: the execution sample i came from (an agent session split into several
    samples). The group's mean, std and n are then over its executions, each counting once with
    the mean reward of its samples, so a session that produced more samples does not weigh more
    in the baseline; each sample is still scored with its own reward.

    Returns:
        float32 tensor [num_samples].
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
    if len(rewards) != len(group_indices):
        raise ValueError(f"{len(rewards)} rewards but {len(group_indices)} group indices")
    r = torch.tensor(list(rewards), dtype=torch.float32)
    if estimator in ("reinforce_plus_plus", "ppo"):  # PPO's baseline is the critic
        return r
    out = torch.zeros_like(r)
    for members in _groups(group_indices).values():
        idx = torch.tensor(members)
        g = r[idx]
        if executions is not None:  # one value per execution: the statistics count each once
            runs = _groups([executions[m] for m in members])
            g_stats = torch.stack([g[torch.tensor(run)].mean() for run in runs.values()])
        else:
            g_stats = g
        n = g_stats.numel()
        if n < 2:
            continue
        centered = g - g_stats.mean()
        if estimator in ("grpo", "gspo") and std_normalization:
            centered = centered / (g_stats.std(unbiased=True) + GROUP_STD_EPS)
        elif estimator == "rloo":
            centered = centered * (n / (n - 1))
        out[idx] = centered
    return out


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{k >= t, mask_k} gamma^(k - t') r_k over one response (masked tokens skipped).

    Masked-out tokens (e.g. tool output inside a multi-turn response) neither receive a return
    nor advance the discount; their return is 0.
    """
    returns = torch.zeros_like(token_rewards)
    running = token_rewards.new_zeros(())
    for t in range(token_rewards.numel() - 1, -1, -1):
        if mask[t]:
            running = token_rewards[t] + gamma * running
            returns[t] = running
    return returns


def compute_advantages(
    estimator: str,
    sample_scalars: torch.Tensor,
    loss_masks: Sequence[torch.Tensor],
    kl: Sequence[torch.Tensor] | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
) -> list[torch.Tensor]:
    """Per-token advantages (before whitening), one 1-D tensor per sample.

    - grpo, gspo, rloo: A_it = s_i for every response token t (s from `normalize_group_rewards`).
    - reinforce_plus_plus: token reward x_t = -kl_coef * kl_t, plus s_i on the last unmasked
      token; A_it = discounted_returns(x, gamma).
    - reinforce_plus_plus_baseline: A_it = s_i - kl_coef * kl_t.

    Args:
        sample_scalars: [num_samples] from `normalize_group_rewards`.
        loss_masks: per sample, [response_length] of 0/1.
        kl: per sample, [response_length] KL(actor || reference) estimate; needed by the
            REINFORCE++ family when kl_coef != 0.
    """
    needs_kl = estimator.startswith("reinforce_plus_plus") and kl_coef != 0.0
    if needs_kl and kl is None:
        raise ValueError(
            f"--advantage-estimator {estimator} with --kl-coef {kl_coef} needs reference log-probs"
        )
    advantages = []
    for i, mask in enumerate(loss_masks):
        mask_f = mask.to(torch.float32)
        scalar = sample_scalars[i]
        kl_i = kl[i].to(torch.float32) if needs_kl and kl is not None else torch.zeros_like(mask_f)
        if estimator == "reinforce_plus_plus":
            token_rewards = -kl_coef * kl_i
            unmasked = mask.nonzero()
            if unmasked.numel():
                token_rewards = token_rewards.clone()
                token_rewards[unmasked[-1, 0]] += scalar
            advantages.append(discounted_returns(token_rewards, mask, gamma) * mask_f)
        elif estimator == "reinforce_plus_plus_baseline":
            advantages.append((scalar - kl_coef * kl_i) * mask_f)
        elif estimator in ("grpo", "gspo", "rloo"):
            advantages.append(scalar * mask_f)
        elif estimator == "ppo":
            raise ValueError("ppo's advantages need the critic's values: ppo_advantages")
        else:
            raise ValueError(f"unknown advantage estimator {estimator!r}")
    return advantages


def whitening_stats(values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]) -> torch.Tensor:
    """Local [sum, sum of squares, count] over masked tokens, float64, for an all-reduce."""
    stats = torch.zeros(3, dtype=torch.float64)
    for v, m in zip(values, masks):
        m_b = m.bool()
        sel = v[m_b].to(torch.float64)
        stats[0] += sel.sum()
        stats[1] += (sel * sel).sum()
        stats[2] += sel.numel()
    return stats


def whiten(
    values: Sequence[torch.Tensor], masks: Sequence[torch.Tensor], stats: torch.Tensor
) -> list[torch.Tensor]:
    """(A - mean) / sqrt(var + 1e-8) on masked tokens, with mean/var (biased) from global `stats`.

    Masked-out tokens stay 0. `stats` is the all-reduced output of `whitening_stats`.
    """
    total, total_sq, count = (float(x) for x in stats)
    if count == 0:
        return [v.clone() for v in values]
    mean = total / count
    var = max(total_sq / count - mean * mean, 0.0)
    scale = 1.0 / (var + WHITEN_EPS) ** 0.5
    return [((v - mean) * scale) * m.to(v.dtype) for v, m in zip(values, masks)]


def gae(
    token_rewards: torch.Tensor, values: torch.Tensor, gamma: float, lambd: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over one response (Schulman et al. 2016), as slime's PPO:

        delta_t = r_t + gamma * V_{t+1} - V_t        (V after the last token: 0, the episode ends)
        A_t     = delta_t + gamma * lambd * A_{t+1}
        R_t     = A_t + V_t                           (the critic's target)

    Every response token takes part, loss-masked ones too (tool output inside a multi-turn
    response still passes the reward back); the masks act in the losses only.

    Returns:
        (advantages, returns), float32, each [response_length].
    """
    r, v = token_rewards.to(torch.float32), values.to(torch.float32)
    if r.shape != v.shape:
        raise ValueError(f"{r.numel()} token rewards but {v.numel()} values")
    # A loop over Python floats (float64): a loop over 0-d tensors costs microseconds per token.
    rewards, vals = r.tolist(), v.tolist()
    out = [0.0] * len(rewards)
    running, following = 0.0, 0.0
    for t in range(len(rewards) - 1, -1, -1):
        running = rewards[t] + gamma * following - vals[t] + gamma * lambd * running
        out[t], following = running, vals[t]
    advantages = torch.tensor(out, dtype=torch.float32)
    return advantages, advantages + v


def ppo_token_rewards(
    reward: float | torch.Tensor, length: int, kl: torch.Tensor | None, kl_coef: float
) -> torch.Tensor:
    """PPO's per-token rewards of one response: -kl_coef * KL(actor || reference) on every token,
    and the sample's reward added on its last token (as slime places it)."""
    out = torch.zeros(length, dtype=torch.float32)
    if kl is not None and kl_coef != 0.0:
        out = out - kl_coef * kl.to(torch.float32)
    out[-1] += float(reward)
    return out


def ppo_advantages(
    sample_rewards: torch.Tensor,
    values: Sequence[torch.Tensor],
    loss_masks: Sequence[torch.Tensor],
    kl: Sequence[torch.Tensor] | None,
    kl_coef: float,
    gamma: float,
    lambd: float,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """PPO's per-token (advantages, returns), one tensor each per sample: GAE (`gae`) over the
    critic's values of the token rewards (`ppo_token_rewards`). Advantages are 0 on masked-out
    tokens, like every estimator's; returns are kept on every token (the critic's loss masks)."""
    if kl_coef != 0.0 and kl is None:
        raise ValueError(f"--advantage-estimator ppo with --kl-coef {kl_coef} needs reference log-probs")
    advantages, returns = [], []
    for i, (v, mask) in enumerate(zip(values, loss_masks, strict=True)):
        rewards = ppo_token_rewards(sample_rewards[i], mask.numel(), None if kl is None else kl[i], kl_coef)
        a, r = gae(rewards, v, gamma, lambd)
        advantages.append(a * mask.to(torch.float32))
        returns.append(r)
    return advantages, returns


def opd_penalty(
    advantages: Sequence[torch.Tensor],
    student_log_probs: Sequence[torch.Tensor],
    teacher_log_probs: Sequence[torch.Tensor],
    coef: float,
    masks: Sequence[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """On-policy distillation (slime's --use-opd): each token's advantage minus `coef` times the
    per-token reverse KL estimate log p_student - log p_teacher of the sampled token, after any
    estimator and before whitening. With `masks`, tokens outside the loss keep their advantage
    (0), as every estimator leaves them; slime subtracts there too, which no loss reads."""
    out = []
    for i, (a, s, t) in enumerate(zip(advantages, student_log_probs, teacher_log_probs, strict=True)):
        if not a.shape == s.shape == t.shape:
            raise ValueError(
                f"sample {i}: {a.numel()} advantages, {s.numel()} student and {t.numel()} teacher log-probs"
            )
        penalty = coef * (s.to(torch.float32) - t.to(torch.float32))
        if masks is not None:
            penalty = penalty * masks[i].to(torch.float32)
        out.append(a - penalty)
    return out


def explained_variance(
    values: Sequence[torch.Tensor], returns: Sequence[torch.Tensor], masks: Sequence[torch.Tensor]
) -> torch.Tensor:
    """Local sums for 1 - Var(R - V) / Var(R) over the masked tokens of a rollout: [n, sum R,
    sum R^2, sum (R - V), sum (R - V)^2], float64, to all-reduce before `explained_variance_of`."""
    stats = torch.zeros(5, dtype=torch.float64)
    for v, r, m in zip(values, returns, masks, strict=True):
        keep = m.bool()
        rr, d = r[keep].double(), (r - v)[keep].double()
        stats += torch.stack([rr.new_tensor(rr.numel()), rr.sum(), (rr * rr).sum(), d.sum(), (d * d).sum()])
    return stats


def explained_variance_of(stats: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) from all-reduced `explained_variance` sums (nan when Var(R) is 0)."""
    n, sr, srr, sd, sdd = (float(x) for x in stats)
    if n == 0:
        return float("nan")
    var_r = srr / n - (sr / n) ** 2
    var_d = sdd / n - (sd / n) ** 2
    # Equal returns leave only rounding in var_r (relative to their square): undefined, not huge.
    return float("nan") if var_r <= 1e-12 * max(1.0, srr / n) else 1.0 - var_d / var_r
