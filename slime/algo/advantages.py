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
) -> torch.Tensor:
    """Per-sample reward scalars after the estimator's group baseline.

    With r_i the reward of sample i and G(i) its group (same prompt):

    - grpo, gspo:   (r_i - mean_G) / (std_G + 1e-6), std unbiased (n - 1); without
      std normalization (`--disable-grpo-std-normalization`) only r_i - mean_G.
    - rloo:         r_i - mean_{j in G, j != i} r_j  =  n / (n - 1) * (r_i - mean_G).
    - reinforce_plus_plus_baseline: r_i - mean_G.
    - reinforce_plus_plus: r_i unchanged (no baseline).

    A group of one sample has no baseline to compare with: its scalar is 0 for every estimator
    that uses a group baseline.

    Returns:
        float32 tensor [num_samples].
    """
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of {', '.join(ESTIMATORS)}")
    if len(rewards) != len(group_indices):
        raise ValueError(f"{len(rewards)} rewards but {len(group_indices)} group indices")
    r = torch.tensor(list(rewards), dtype=torch.float32)
    if estimator == "reinforce_plus_plus":
        return r
    out = torch.zeros_like(r)
    for members in _groups(group_indices).values():
        idx = torch.tensor(members)
        g = r[idx]
        n = g.numel()
        if n < 2:
            continue
        centered = g - g.mean()
        if estimator in ("grpo", "gspo") and std_normalization:
            centered = centered / (g.std(unbiased=True) + GROUP_STD_EPS)
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
