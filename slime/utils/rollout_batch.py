"""The data contract: what the producers of rollouts and the trainers exchange.

A rollout is produced as `Sample`s (slime.utils.sample), turned into one `RolloutBatch` and cut
into one `RolloutPart` per data-parallel replica with `split_rollout`, by the same rule every
train rank plans with (slime.utils.step_plans), so each rank fetches only its own part; an actor
given the whole `RolloutBatch` (tests, tools) cuts its share itself. A train rank answers with a
`TrainOutput`. The driver sees a finished rollout as a `Rollout` (a summary and one handle per
replica, never the samples) and an evaluation as an `Evaluation`.

This module sits on the ground floor: the rollout package, the train backends, the loop and the
Ray layer all import it, and it imports nothing of theirs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class BatchError(ValueError):
    """A rollout batch the train side cannot use (names the field and the flag involved)."""


@dataclass
class RolloutBatch:
    """One rollout's samples, after reward and before any normalisation.

    Per sample i: `tokens[i]` = prompt + response ids; the last `response_lengths[i]` of them
    are the response. `loss_masks[i]` and `rollout_log_probs[i]` have one entry per response
    token. `group_indices[i]` names the prompt group (samples of one prompt share it).
    `rollout_ids[i]` names the execution the sample came from (several samples of one agent
    session share it; None: each sample is its own).
    """

    tokens: list[list[int]]
    response_lengths: list[int]
    rewards: list[float]
    group_indices: list[int]
    loss_masks: list[list[int]] | None = None
    rollout_log_probs: list[list[float]] | None = None
    sample_indices: list[int] | None = None
    rollout_routed_experts: list[Any] | None = None
    """Mixture-of-experts models: per sample, the experts the engine routed each token to,
    [tokens - 1, layers, top-k] (slime's field; --use-rollout-routing-replay trains with them)."""
    teacher_log_probs: list[list[float]] | None = None
    """On-policy distillation: the teacher's log-prob of each response token (slime's field; set
    by the rollout's teacher engine, --opd-type sglang)."""
    rollout_ids: list[int | None] | None = None
    """slime's field: per sample, the execution (one run of the generate function) it came from.
    A step takes --global-batch-size executions, and the per-sample loss is a mean over them."""
    weight_versions: list[str | None] | None = None
    """The engine weight version each sample was generated with (None: several, or none reported);
    --keep-old-actor takes the old policy's log-probs with those weights."""
    multimodal_train_inputs: list[dict[str, Any] | None] | None = None
    """Vision-language prompts (slime's field): per sample, the processor's tensors of its images
    (`pixel_values`, `image_grid_thw`) that the trainer's forward takes with `tokens`; None for a
    sample without images (None overall: a text-only rollout)."""
    rewards_normalized: bool = False
    """`rewards` came from --custom-reward-post-process-path: the advantages start from them as
    they are (no group baseline on the train side)."""

    def __len__(self) -> int:
        return len(self.tokens)

    def validate(self, vocab_size: int | None = None, need_rollout_log_probs: bool = False) -> None:
        """Raise BatchError naming the first inconsistent field."""
        n = len(self.tokens)
        if n == 0:
            raise BatchError("rollout batch is empty")
        for name in (
            "response_lengths",
            "rewards",
            "group_indices",
            "loss_masks",
            "rollout_log_probs",
            "rollout_routed_experts",
            "teacher_log_probs",
            "rollout_ids",
            "multimodal_train_inputs",
        ):
            value = getattr(self, name)
            if value is not None and len(value) != n:
                raise BatchError(f"batch field '{name}' has {len(value)} entries for {n} samples")
        if need_rollout_log_probs and self.rollout_log_probs is None:
            raise BatchError(
                "--use-tis / --use-rollout-logprobs / --use-decoupled-loss need the engine's log-probs, "
                "but the batch has no 'rollout_log_probs' (generate with return_logprob, or drop the "
                "flag)"
            )
        for i in range(n):
            length, r_len = len(self.tokens[i]), self.response_lengths[i]
            if not 0 < r_len < length:
                raise BatchError(
                    f"sample {i}: response_length {r_len} must be in [1, {length - 1}] for {length} tokens "
                    "(a sample needs at least one prompt and one response token)"
                )
            for name in ("loss_masks", "rollout_log_probs", "teacher_log_probs"):
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
            rollout_routed_experts=pick(self.rollout_routed_experts),
            teacher_log_probs=pick(self.teacher_log_probs),
            sample_indices=[base[i] for i in indices],
            rollout_ids=pick(self.rollout_ids),
            weight_versions=pick(self.weight_versions),
            multimodal_train_inputs=pick(self.multimodal_train_inputs),
            rewards_normalized=self.rewards_normalized,
        )


@dataclass
class RolloutPart:
    """One data-parallel replica's samples of a rollout, and what every replica must agree on.

    `batch` holds the replica's samples (whole rows, rollout order) at rollout `positions`; the
    other fields have one entry per sample of the *whole* rollout: the plan (optimizer steps,
    every replica's micro-batch count, the per-step normalisers) and group-normalised rewards
    need them, and they are a few numbers per sample.
    """

    batch: RolloutBatch
    positions: list[int]
    lengths: list[int]
    """Tokens (prompt + response) of every sample."""
    loss_tokens: list[int]
    """Loss-mask tokens of every sample."""
    rewards: list[float]
    group_indices: list[int]
    executions: list[int] | None = None
    """Every sample's execution (`step_plans.execution_keys`); None: each sample its own."""
    dp_size: int | None = None
    """The number of replicas the rollout was split for; None: the whole rollout."""

    @property
    def rewards_normalized(self) -> bool:
        """See RolloutBatch.rewards_normalized (the part's samples carry it)."""
        return self.batch.rewards_normalized

    @property
    def num_samples(self) -> int:
        return len(self.lengths)

    @property
    def num_executions(self) -> int:
        """Executions in the rollout: what --global-batch-size counts."""
        return self.num_samples if self.executions is None else len(set(self.executions))

    @classmethod
    def of(cls, data: RolloutBatch | RolloutPart) -> RolloutPart:
        """`data` as a part: a part as it is, a whole rollout as one part."""
        return data if isinstance(data, RolloutPart) else cls.whole(data)

    @classmethod
    def whole(cls, batch: RolloutBatch) -> RolloutPart:
        """The whole rollout as one part (a rank given it cuts its share itself)."""
        from slime.utils.step_plans import execution_keys

        masks = batch.loss_masks
        keys = execution_keys(batch.rollout_ids, len(batch))
        return cls(
            batch=batch,
            positions=list(range(len(batch))),
            lengths=[len(t) for t in batch.tokens],
            loss_tokens=[
                int(sum(masks[i])) if masks is not None else batch.response_lengths[i]
                for i in range(len(batch))
            ],
            rewards=list(batch.rewards),
            group_indices=list(batch.group_indices),
            executions=None if len(set(keys)) == len(keys) else keys,
        )


def split_rollout(batch: RolloutBatch, batch_cfg: Any, dp_size: int) -> list[RolloutPart]:
    """The rollout cut into one part per data-parallel replica, by `step_plans.step_shares` (the
    rule every rank plans with). `batch_cfg` is the train config's BatchConfig."""
    from slime.utils.step_plans import step_shares

    whole = RolloutPart.whole(batch)
    global_batch = batch_cfg.global_batch_for(whole.num_executions)
    batch_cfg.check_layout(dp_size, global_batch)
    shares = step_shares(whole.lengths, global_batch, dp_size, whole.executions)
    parts = []
    for d in range(dp_size):
        positions = sorted(p for step in shares for p in step[d])
        parts.append(
            RolloutPart(
                batch.subset(positions),
                positions,
                whole.lengths,
                whole.loss_tokens,
                whole.rewards,
                whole.group_indices,
                whole.executions,
                dp_size,
            )
        )
    return parts


@dataclass
class TrainOutput:
    """What one `train` call reports: per-optimizer-step metrics and rollout-level metrics."""

    steps: list[dict[str, float]] = field(default_factory=list)
    rollout: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    """Wall seconds on this rank: `log_probs` (old and reference passes), `train` (optimizer steps)."""
    perf: dict[str, float] = field(default_factory=dict)
    """slime's perf/* throughput (slime.utils.flops.step_perf): `actor_train_tok_per_s`,
    `actor_train_tflops`, `log_probs_tflops`, `ref_log_probs_tflops`, `actor_train_mfu`, where
    the passes ran and the numbers are known."""
    returns: Any = None
    """PPO: the returns of this rank's samples, keyed by sample index (the critic's targets); a
    Ray job sends them on by reference."""
    precision: dict[str, float] = field(default_factory=dict)
    """With --check-precision, over all ranks: `ref_max_abs_diff` and `ref_tokens_differ` (actor vs
    reference), `nonfinite` and `max_log_prob` (the actor's log-probs), `first_step_max_abs_diff`
    (log-prob pass vs the first optimizer step's forward); all over the loss mask."""


@dataclass(frozen=True)
class Rollout:
    """A finished rollout as the driver sees it: a summary, never the samples.

    The samples stay where they were made: `parts` holds one handle per data-parallel replica (a
    Ray object reference in a job, the `RolloutPart` itself in-process), which the train group
    hands to the ranks of that replica.
    """

    rollout_id: int
    metrics: dict[str, float]
    """rollout/* (reward, accuracy, lengths, truncation, sample count) and time/generate, time/reward."""
    num_samples: int
    weight_versions: tuple[str | None, ...]
    """The distinct weight versions the samples were generated with (None: an engine reported none)."""
    data_state: dict[str, int] | None = None
    """The data position after this rollout (saved with checkpoints); None for a replayed rollout."""
    dump_path: str | None = None
    """Where --save-debug-rollout-data wrote it."""
    parts: tuple[Any, ...] = ()
    replayed: bool = False


@dataclass(frozen=True)
class Evaluation:
    """eval/* metrics of one evaluation, and where --save-debug-eval-data wrote its samples."""

    metrics: dict[str, float]
    dump_path: str | None = None
