"""The contract between the loop (or a test) and a train backend.

A train actor is one data-parallel rank. Every rank receives the *whole* rollout as a
`RolloutBatch`; the actor cuts its own share, so the loop never needs to know the layout and a
replay of a saved rollout splits over the current layout. The `TrainActor` protocol is what the
Ray layer calls; tests call it directly, one process per rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


class BatchError(ValueError):
    """A rollout batch the train side cannot use (names the field and the flag involved)."""


@dataclass
class RolloutBatch:
    """One rollout's samples, after reward and before any normalisation.

    Per sample i: `tokens[i]` = prompt + response ids; the last `response_lengths[i]` of them
    are the response. `loss_masks[i]` and `rollout_log_probs[i]` have one entry per response
    token. `group_indices[i]` names the prompt group (samples of one prompt share it).
    """

    tokens: list[list[int]]
    response_lengths: list[int]
    rewards: list[float]
    group_indices: list[int]
    loss_masks: list[list[int]] | None = None
    rollout_log_probs: list[list[float]] | None = None
    sample_indices: list[int] | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def validate(self, vocab_size: int | None = None, need_rollout_log_probs: bool = False) -> None:
        """Raise BatchError naming the first inconsistent field."""
        n = len(self.tokens)
        if n == 0:
            raise BatchError("rollout batch is empty")
        for name in ("response_lengths", "rewards", "group_indices", "loss_masks", "rollout_log_probs"):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise BatchError(f"batch field '{name}' has {len(value)} entries for {n} samples")
        if need_rollout_log_probs and self.rollout_log_probs is None:
            raise BatchError(
                "--use-tis needs the engine's log-probs, but the batch has no 'rollout_log_probs' "
                "(generate with return_logprob, or drop --use-tis)"
            )
        for i in range(n):
            length, r_len = len(self.tokens[i]), self.response_lengths[i]
            if not 0 < r_len < length:
                raise BatchError(
                    f"sample {i}: response_length {r_len} must be in [1, {length - 1}] for {length} tokens "
                    "(a sample needs at least one prompt and one response token)"
                )
            for name in ("loss_masks", "rollout_log_probs"):
                value = getattr(self, name)
                if value is not None and len(value[i]) != r_len:
                    raise BatchError(
                        f"sample {i}: '{name}' has {len(value[i])} entries, response_length is {r_len}"
                    )
            if vocab_size is not None and any(not 0 <= t < vocab_size for t in self.tokens[i]):
                raise BatchError(f"sample {i}: token ids outside the model's vocabulary [0, {vocab_size})")

    def subset(self, indices: list[int]) -> RolloutBatch:
        """The samples at `indices`, in that order (keeps their original sample_indices)."""

        def pick(values):
            return None if values is None else [values[i] for i in indices]

        base = self.sample_indices if self.sample_indices is not None else list(range(len(self)))
        return RolloutBatch(
            tokens=[self.tokens[i] for i in indices],
            response_lengths=[self.response_lengths[i] for i in indices],
            rewards=[self.rewards[i] for i in indices],
            group_indices=[self.group_indices[i] for i in indices],
            loss_masks=pick(self.loss_masks),
            rollout_log_probs=pick(self.rollout_log_probs),
            sample_indices=[base[i] for i in indices],
        )


@dataclass
class TrainOutput:
    """What one `train` call reports: per-optimizer-step metrics and rollout-level metrics."""

    steps: list[dict[str, float]] = field(default_factory=list)
    rollout: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    """Wall seconds on this rank: `log_probs` (old and reference passes), `train` (optimizer steps)."""
    precision: dict[str, float] = field(default_factory=dict)
    """With --check-precision, over all ranks: `ref_max_abs_diff` and `ref_tokens_differ` (actor vs
    reference), `nonfinite` and `max_log_prob` (the actor's log-probs), `first_step_max_abs_diff`
    (log-prob pass vs the first optimizer step's forward); all over the loss mask."""


class TrainActor(Protocol):
    """One data-parallel rank of a train backend."""

    def init(self) -> dict[str, Any]:
        """Build the model (and reference), optimizer and scheduler; resume from --load if set.
        Returns facts for the start-up banner (parameter counts, memory, resumed step)."""
        ...

    def compute_log_probs(self, batch: RolloutBatch, use_reference: bool = False) -> dict[int, list[float]]:
        """Log-probs of this rank's share of the response tokens, keyed by sample index."""
        ...

    def train(self, rollout_id: int, batch: RolloutBatch) -> TrainOutput:
        """Log-prob pass, advantages, then the rollout's optimizer steps."""
        ...

    def save(self, rollout_id: int, path: str, extra: dict[str, Any] | None = None) -> str:
        """Write a resumable checkpoint under `path` (with `extra` plain data such as the data
        position, returned as `resumed_extra` by init on resume); returns the iteration directory."""
        ...

    def save_hf(self, path: str) -> None:
        """Export a plain Hugging Face checkpoint that AutoModelForCausalLM loads."""
        ...

    def export_weights(
        self, bucket_bytes: int, every_rank: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """(HF name, full tensor) in buckets of at most `bucket_bytes`; every rank must iterate.
        Rank 0 receives the tensors; with `every_rank` (the CUDA-IPC push) every rank does."""
        ...

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """HF name → full shape of every tensor export_weights yields (no communication)."""
        ...

    def sleep(self, keep_params: bool = False) -> None:
        """Release device memory (colocated engines run meanwhile); with `keep_params` only what
        the weight push does not read (optimizer states)."""
        ...

    def wake(self) -> None:
        """Take device memory back before the next train call."""
        ...

    def close(self) -> None: ...
