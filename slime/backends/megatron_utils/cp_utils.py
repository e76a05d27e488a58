"""Context-parallel helpers that slime's loss hooks call (its TIS example gathers the engine's
and the trainer's log-probs with them before weighting, and slices the result back).

Here the loss always sees whole sequences, with context parallelism too (the Megatron actor
gathers the log-probs over the CP ranks before the loss: slime.backends.megatron.context_parallel),
so gathering and slicing return their input. Signatures as in slime.
"""

from __future__ import annotations

import torch


def all_gather_with_cp(tensor: torch.Tensor, total_length: int, response_length: int) -> torch.Tensor:
    """One sample's per-token values over the whole response (this rank already has them all)."""
    return tensor


def slice_log_prob_with_cp(
    log_prob: list[float] | torch.Tensor, total_length: int, response_length: int
) -> list[float] | torch.Tensor:
    """This rank's part of one sample's per-token values (all of them, without context parallelism)."""
    return log_prob
