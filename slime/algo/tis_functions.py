"""slime's two TIS functions for `--custom-tis-function-path`, with slime's hook signature
(slime.algo.plugins calls them on one micro-batch). slime's scripts name them by slime's path,
slime.backends.megatron_utils.loss, which re-exports them from here.

Both weight the per-token policy loss by a function of r = exp(log p_trainer_old - log p_engine)
and report slime's metrics (one value per token, averaged over the loss masks given):
`tis` = r, `tis_abs` = |r - 1|, `tis_clipfrac` = 1 where the weight differs from r.

- `vanilla_tis_function`: w = clamp(r, tis_clip_low, tis_clip), the built-in --use-tis.
- `icepop_function`: w = r inside [tis_clip_low, tis_clip], 0 outside (IcePop-style masking:
  tokens whose two policies disagree too much leave the loss instead of being clamped), e.g.
  `--use-tis --custom-tis-function-path slime.backends.megatron_utils.loss.icepop_function
  --tis-clip-low 0.5 --tis-clip 2.0`.

Neither rejects tokens: the loss masks come back as given.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch

from slime.algo import losses

TisResult = tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]


def vanilla_tis_function(
    args: argparse.Namespace,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    **kwargs: Any,
) -> TisResult:
    """Truncated importance sampling: pg_loss * clamp(r, args.tis_clip_low, args.tis_clip)."""
    return _weighted(losses.tis_weights, args, pg_loss, train_log_probs, rollout_log_probs, loss_masks)


def icepop_function(
    args: argparse.Namespace,
    *,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
    **kwargs: Any,
) -> TisResult:
    """IcePop-style masking: pg_loss * r where args.tis_clip_low <= r <= args.tis_clip, else 0."""
    return _weighted(losses.icepop_weights, args, pg_loss, train_log_probs, rollout_log_probs, loss_masks)


def _weighted(
    weigh: Callable[[torch.Tensor, torch.Tensor, float, float], tuple[torch.Tensor, torch.Tensor]],
    args: argparse.Namespace,
    pg_loss: torch.Tensor,
    train_log_probs: list[torch.Tensor],
    rollout_log_probs: list[torch.Tensor],
    loss_masks: list[torch.Tensor],
) -> TisResult:
    old = torch.cat(list(train_log_probs), dim=0)
    engine = torch.cat(list(rollout_log_probs), dim=0)
    weights, changed = weigh(old, engine, args.tis_clip, args.tis_clip_low)
    ratio = torch.exp(old.float() - engine.float()).detach()
    metrics = {"tis": ratio, "tis_abs": (ratio - 1).abs(), "tis_clipfrac": changed}
    return pg_loss * weights, loss_masks, metrics
