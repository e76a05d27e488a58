"""The contracts of the trainer, at its two edges.

- `TrainActor`: what the Ray layer (or a test) calls on one data-parallel rank, one process per
  rank. A rank trains on a `RolloutPart` (slime.utils.rollout_batch, the data contract): its replica's
  samples and the few per-sample numbers of the whole rollout that every replica's plan needs.
  slime.backends.policy.PolicyTrainer implements it over a backend; `CriticActor` is PPO's
  critic's (slime.backends.value.ValueTrainer).
- `TrainBackend` and `ValueBackend`: what a backend (FSDP, Megatron) provides to those two: the
  model's forward passes, its optimizer step, its weights (for the reference swap, the push and
  the old-actor copies) and its checkpoints. The step itself (planning, the loss, advantages,
  metrics) is backend-independent and never touches the model but through these.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from slime.utils.rollout_batch import RolloutBatch, RolloutPart, TrainOutput
from slime.utils.step_plans import StepPlan

if TYPE_CHECKING:  # the driver imports this module, and never needs torch itself
    import torch

    from slime.backends.micro_batch import MicroBatch
    from slime.backends.routing import RouterHooks
    from slime.config.train import TrainConfig

State = dict[str, "torch.Tensor"]
"""This rank's part of a model's weights, by the backend's own parameter names (on the host)."""
PerPosition = dict[int, "torch.Tensor"]
"""A per-token tensor of each sample, keyed by its position in the rank's batch."""


class TrainActor(Protocol):
    """One data-parallel rank of a train backend."""

    @property
    def cfg(self) -> TrainConfig: ...

    @property
    def rank(self) -> int: ...

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

    def keep_weights(self, version: str) -> None:
        """--keep-old-actor: the weights about to be pushed as `version`, kept on the host."""
        ...

    @property
    def pushes_adapter(self) -> bool:
        """--lora-push adapter: a push sends the LoRA adapter alone."""
        ...

    def export_adapter(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        """LoRA: the adapter whole under PEFT's names, and its PEFT config (every rank takes part)."""
        ...

    def close(self) -> None: ...


class CriticActor(Protocol):
    """One data-parallel rank of PPO's critic (slime.backends.value.ValueTrainer)."""

    @property
    def cfg(self) -> TrainConfig: ...

    def init(self) -> dict[str, Any]: ...

    def compute_values(self, batch: RolloutBatch | RolloutPart) -> dict[int, list[float]]:
        """The value of every response token of this rank's samples, keyed by sample index."""
        ...

    def train_values(
        self,
        rollout_id: int,
        batch: RolloutBatch | RolloutPart,
        old_values: dict[int, list[float]],
        returns: dict[int, list[float]],
    ) -> TrainOutput:
        """Optimizer steps of the clipped value loss against `returns`."""
        ...

    def save(self, rollout_id: int, path: str, extra: dict[str, Any] | None = None) -> str: ...

    def save_hf(self, path: str) -> None: ...

    def sleep(self, keep_params: bool = False) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


class MicroBatchLoss(Protocol):
    """The policy's loss of one micro-batch, given to `TrainBackend.train_step`: from the
    forward's `log_probs` and `entropy` ([batch, max response], with grad) its share of the step's
    loss, its metric sums added to `sums`."""

    def __call__(
        self, mb: MicroBatch, log_probs: torch.Tensor, entropy: torch.Tensor, sums: dict[str, torch.Tensor]
    ) -> torch.Tensor: ...


class ValueLoss(Protocol):
    """The critic's loss of one micro-batch from its `values` ([batch, max response], with grad)."""

    def __call__(
        self, mb: MicroBatch, values: torch.Tensor, sums: dict[str, torch.Tensor]
    ) -> torch.Tensor: ...


@dataclass
class Pass:
    """What a forward-only pass is asked for: routing replay's tables (`replay`: per position the
    experts of each token, [tokens, layers, top-k], -1 for the router's own; None: the routers
    choose), the entropy beside the log-probs (--use-rollout-entropy), the routing recorded (R2)."""

    replay: PerPosition | None = None
    entropy: bool = False
    record: bool = False


@dataclass
class PassResult:
    """A log-prob pass's answer, by position: the log-probs (and entropy) on every rank of the
    replica; the routing of the layers this rank holds (a pipeline stage: its own layers)."""

    log_probs: PerPosition
    entropy: PerPosition | None = None
    routing: PerPosition | None = None
    """With `Pass.record`: the experts each token was routed to (R2's tables)."""


class TrainBackend(Protocol):
    """One rank of a backend's model: what slime.backends.policy.PolicyTrainer drives."""

    cfg: TrainConfig
    hf_config: Any
    device: torch.device
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    dp_group: Any
    """Process group over which one sample's values are counted once (None: the default group)."""
    context_parallel: int
    """Ranks a sequence is split over (Megatron's CP): a rank's token budget is multiplied by it."""
    writes_train_data: bool
    """Whether this rank writes its replica's files and counts its metrics (one rank per replica)."""
    optimizer: torch.optim.Optimizer
    ref_state: State | None
    """This rank's part of the reference weights (None: the loss uses no reference)."""
    teacher_state: State | None
    """This rank's part of the OPD teacher's weights (--opd-type megatron; None otherwise)."""

    def __init__(
        self, cfg: TrainConfig, rank: int | None, world_size: int | None, init_method: str | None
    ) -> None:
        """Nothing is built yet (`init` builds): a trainer makes its backend from its own arguments."""
        ...

    @property
    def routing(self) -> RouterHooks | None:
        """The router hooks of a mixture-of-experts model (None: a dense model)."""
        ...

    def init(self) -> dict[str, Any]: ...

    def log_prob_pass(self, batch: RolloutBatch, plans: list[StepPlan], how: Pass) -> PassResult:
        """Log-probs of the samples in `plans`, on every rank of the replica."""
        ...

    def train_step(
        self, batch: RolloutBatch, step: StepPlan, loss: MicroBatchLoss, replay: PerPosition | None
    ) -> dict[str, float]:
        """One optimizer step over the step's micro-batches (gradients accumulated, clipped): its
        metrics summed over every rank, with grad_norm and lr."""
        ...

    def snapshot(self) -> State:
        """A host copy of this rank's part of the weights."""
        ...

    def copy_in(self, state: State) -> None:
        """A `snapshot`-shaped state into this rank's weights."""
        ...

    def reference_weights(self) -> contextlib.AbstractContextManager[None]:
        """Context: the reference's weights are in the model (LoRA: the adapters off)."""
        ...

    def save(self, rollout_id: int, path: str, extra: dict[str, Any] | None = None) -> str: ...

    def save_hf(self, path: str) -> None: ...

    def export_weights(
        self, bucket_bytes: int, every_rank: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]: ...

    def export_adapter(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        """LoRA: the adapters whole under PEFT's names, and their PEFT config."""
        ...

    def weight_shapes(self) -> dict[str, tuple[int, ...]]: ...

    def sleep(self, keep_params: bool = False) -> None: ...

    def wake(self) -> None: ...

    def close(self) -> None: ...


class ValueBackend(TrainBackend, Protocol):
    """A backend's model with a value head: what slime.backends.value.ValueTrainer drives."""

    def value_pass(self, batch: RolloutBatch, plans: list[StepPlan]) -> PerPosition:
        """The values of this rank's samples; ranks that do not answer for their replica
        (Megatron's other TP and pipeline ranks) return none."""
        ...

    def value_step(self, batch: RolloutBatch, step: StepPlan, loss: ValueLoss) -> dict[str, float]:
        """One optimizer step of the value loss; its metrics summed over every rank."""
        ...
