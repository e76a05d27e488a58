"""The contract between the loop (or a test) and a train backend: the `TrainActor` protocol, what
the Ray layer calls on one data-parallel rank; tests call it directly, one process per rank. A
rank trains on a `RolloutPart` (slime.utils.batch, the data contract): its replica's samples and
the few per-sample numbers of the whole rollout that every replica's plan needs.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from slime.utils.batch import RolloutBatch, RolloutPart, TrainOutput

if TYPE_CHECKING:  # the driver imports this module, and never needs torch itself
    import torch


class TrainActor(Protocol):
    """One data-parallel rank of a train backend."""

    def init(self) -> dict[str, Any]:
        """Build the model (and reference), optimizer and scheduler; resume from --load if set.
        Returns facts for the start-up banner (parameter counts, memory, resumed step)."""
        ...

    def compute_log_probs(self, batch: RolloutBatch, use_reference: bool = False) -> dict[int, list[float]]:
        """Log-probs of this rank's share of the response tokens, keyed by sample index."""
        ...

    def train(
        self,
        rollout_id: int,
        batch: RolloutBatch | RolloutPart,
        values: dict[int, list[float]] | None = None,
        update: bool = True,
    ) -> TrainOutput:
        """Log-prob pass, advantages, then the rollout's optimizer steps, on this rank's part
        (or its share of a whole rollout). PPO: `values` are the critic's (the output carries the
        returns); without `update` no optimizer step is taken (--num-critic-only-steps)."""
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
