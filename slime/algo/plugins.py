"""slime's loss hooks, with slime's call signatures.

`--custom-tis-function-path` (called only with --use-tis, as in slime):

    fn(args, *, pg_loss, train_log_probs, rollout_log_probs, loss_masks, total_lengths,
       response_lengths) -> (pg_loss, loss_masks, metrics)

`--custom-pg-loss-reducer-function-path`:

    factory(total_lengths, response_lengths, loss_masks, calculate_per_token_loss) -> reduce
    reduce(pg_loss) -> scalar tensor

slime hands these functions one micro-batch as per-sample 1-D tensors (`train_log_probs`,
`rollout_log_probs`, `loss_masks`: int) and the per-token policy loss concatenated along the
samples' response tokens (`pg_loss`). Here a micro-batch is laid out [batch, response_len] and
right-padded, so the values are cut to each sample's response before the call and laid out
again after it. The rest follows slime's loss:

- the masks the TIS function returns (rejection sampling) weight the policy loss: a token's
  weight is its returned mask value times its sample's normaliser, which stays the one of the
  masks given (so rejected tokens lower the loss, they do not renormalise it);
- the TIS function's metrics (per-token tensors) are reduced with the masks given, as slime
  reduces them;
- `reduce` is applied to the micro-batch's policy loss in place of the default reduction; its
  value summed over the step's micro-batches and data-parallel ranks is divided by the step's
  sample count (or token count with --calculate-per-token-loss), as slime divides it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

TIS_FLAG = "--custom-tis-function-path"
REDUCER_FLAG = "--custom-pg-loss-reducer-function-path"


@dataclass(frozen=True)
class LossHooks:
    """The loaded loss hooks of one train rank (None where the flag is not given)."""

    args: argparse.Namespace
    tis: Callable[..., Any] | None = None
    pg_loss_reducer: Callable[..., Any] | None = None

    @classmethod
    def load(
        cls, tis_path: str | None, reducer_path: str | None, args: argparse.Namespace | None
    ) -> LossHooks | None:
        if tis_path is None and reducer_path is None:
            return None
        from slime.utils.misc import load_function

        return cls(
            args if args is not None else argparse.Namespace(),
            load_function(tis_path, TIS_FLAG) if tis_path else None,
            load_function(reducer_path, REDUCER_FLAG) if reducer_path else None,
        )


@dataclass
class Ragged:
    """A micro-batch's samples as slime's hooks see them: one 1-D tensor per sample."""

    response_lengths: list[int]
    total_lengths: list[int]

    def split(self, padded: torch.Tensor, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        rows = [padded[i, :n] for i, n in enumerate(self.response_lengths)]
        return [r.to(dtype) for r in rows] if dtype is not None else rows

    def flat(self, padded: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.split(padded), dim=0)

    def pad(self, flat: torch.Tensor, like: torch.Tensor, what: str) -> torch.Tensor:
        """A flat per-token tensor (concatenated responses) laid out like `like`, 0-padded."""
        total = sum(self.response_lengths)
        if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.numel() != total:
            shape = tuple(flat.shape) if isinstance(flat, torch.Tensor) else type(flat).__name__
            raise ValueError(
                f"{what} must be a 1-D tensor with one value per response token of the micro-batch "
                f"({total}), got {shape}"
            )
        out = torch.zeros_like(like, dtype=flat.dtype)
        start = 0
        for i, n in enumerate(self.response_lengths):
            out[i, :n] = flat[start : start + n]
            start += n
        return out

    def pad_rows(self, rows: list[torch.Tensor], like: torch.Tensor, what: str) -> torch.Tensor:
        if not isinstance(rows, list | tuple) or len(rows) != len(self.response_lengths):
            raise ValueError(f"{what} must be a list of {len(self.response_lengths)} tensors, one per sample")
        return self.pad(torch.cat([torch.as_tensor(r).reshape(-1) for r in rows]), like, what)


def custom_tis(
    hooks: LossHooks,
    ragged: Ragged,
    pg_tokens: torch.Tensor,
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Call the TIS function on one micro-batch: (policy loss per token [B, R], the masks it
    returned [B, R], its metrics per token [B, R]), all laid out like `pg_tokens`."""
    assert hooks.tis is not None
    result = hooks.tis(
        hooks.args,
        pg_loss=ragged.flat(pg_tokens),
        train_log_probs=ragged.split(old_log_probs.detach()),
        rollout_log_probs=ragged.split(rollout_log_probs),
        loss_masks=ragged.split(mask, torch.int),
        total_lengths=list(ragged.total_lengths),
        response_lengths=list(ragged.response_lengths),
    )
    if not isinstance(result, tuple | list) or len(result) != 3:
        raise ValueError(
            f"{TIS_FLAG} must return (pg_loss, loss_masks, metrics), got {type(result).__name__}"
        )
    pg_flat, masks, metrics = result
    if not isinstance(metrics, dict):
        raise ValueError(
            f"{TIS_FLAG}: metrics must be a dict of per-token tensors, got {type(metrics).__name__}"
        )
    pg = ragged.pad(pg_flat, pg_tokens, f"{TIS_FLAG}: the returned pg_loss")
    kept = ragged.pad_rows(list(masks), mask, f"{TIS_FLAG}: the returned loss_masks").to(pg_tokens.dtype)
    laid_out = {
        str(k): ragged.pad(torch.as_tensor(v).reshape(-1), pg_tokens, f"{TIS_FLAG}: metric {k!r}").detach()
        for k, v in metrics.items()
    }
    return pg, kept, laid_out


def reduce_pg_loss(
    hooks: LossHooks,
    ragged: Ragged,
    pg_tokens: torch.Tensor,
    mask: torch.Tensor,
    per_token: bool,
    normaliser: float,
    given: bool = True,
) -> torch.Tensor:
    """The micro-batch's share of the policy loss through the reducer: reduce(pg_loss) / the
    step's sample count (or token count, `per_token`). `mask`: the loss masks (`given`, passed as
    int, as slime's batch holds them) or the TIS hook's masks (passed in the hook's dtype)."""
    assert hooks.pg_loss_reducer is not None
    masks = ragged.split(mask, torch.int if given else None)
    reduce = hooks.pg_loss_reducer(
        list(ragged.total_lengths), list(ragged.response_lengths), masks, per_token
    )
    if not callable(reduce):
        raise ValueError(
            f"{REDUCER_FLAG} must return a function of the policy loss, got {type(reduce).__name__}"
        )
    value = reduce(ragged.flat(pg_tokens))
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError(f"{REDUCER_FLAG}: its function must return a scalar tensor, got {value!r:.80}")
    return value.reshape(()).float() / max(normaliser, 1.0)


def row_scale(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each sample's normaliser [B, 1]: token_weights gives mask * scale, so scale = sum(w) / sum(m)."""
    m = mask.float()
    return (weights.sum(-1) / m.sum(-1).clamp(min=1.0)).unsqueeze(-1)
