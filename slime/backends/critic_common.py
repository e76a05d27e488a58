"""The critic of PPO (`--advantage-estimator ppo`), what it does the same way on every train
backend (FSDP: slime.backends.fsdp.critic; Megatron: slime.backends.megatron.critic).

The value model is the actor's transformer with a one-output linear head (slime's value head, a
hidden -> 1 linear with a bias; Hugging Face's *ForTokenClassification `score` head with
`num_labels` 1). A checkpoint without that head (the actor's, slime's default start) gets a fresh
one, `fresh_value_head`: the same on every rank and on both backends.

Per rollout the critic does two things, on the data-parallel layout of the actor's train ranks
(slime.backends.train_common: the same planning, micro-batches and token weights):

- `compute_values`: the value of every response token (read at the position before it, where
  the token's log-prob is predicted), before this rollout's update: the baseline of GAE and the
  V_old of the clipped value loss;
- `train_values`: optimizer steps on the clipped value loss (slime.algo.losses.value_loss)
  against the returns the advantages came with, reduced like the policy loss (per sample, or
  per token with --calculate-per-token-loss).

A backend supplies `_value_pass` (this rank's values of its samples) and `_value_step` (one
optimizer step through `_value_loss`).
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch

from slime.algo import advantages as adv
from slime.algo.losses import token_weights, value_loss, weighted_sum
from slime.backends.micro_batch import MicroBatch
from slime.backends.optim import reset_states
from slime.backends.train_common import TrainActorBase
from slime.utils.batch import BatchError, RolloutBatch, RolloutPart, TrainOutput
from slime.utils.batching import StepPlan

PerSample = dict[int, list[float]]

HEAD_NAMES = ("score.weight", "score.bias")
"""The value head in a Hugging Face directory (a token classifier's `score`)."""


def fresh_value_head(hf_config: Any, seed: int) -> dict[str, torch.Tensor]:
    """slime's value head for a checkpoint without one: N(0, initializer_range) weights, a zero
    bias, drawn on the CPU from `seed` (--seed), so every rank of either backend builds the same."""
    g = torch.Generator().manual_seed(seed)
    text = hf_config.get_text_config()
    std = float(getattr(text, "initializer_range", 0.02))
    weight = torch.randn(1, int(text.hidden_size), generator=g) * std
    return {"score.weight": weight, "score.bias": torch.zeros(1)}


def value_model_config(hf_config: Any) -> Any:
    """The config of the critic's Hugging Face export: a token classifier with one label and no
    dropout before the head, which AutoModelForTokenClassification (and --critic-load) loads."""
    config = copy.deepcopy(hf_config)
    config.num_labels, config.classifier_dropout = 1, 0.0
    config.architectures = [  # the causal LM's, or a vision-language model's (transformers' names)
        a.replace("ForCausalLM", "ForTokenClassification").replace(
            "ForConditionalGeneration", "ForTokenClassification"
        )
        for a in config.architectures or []
    ]
    return config


class ValueModel(TrainActorBase):
    """The backend-independent half of a critic; a backend's critic derives from it and from the
    backend's train actor (whose forward, reductions and optimizer step it uses)."""

    value_head = True

    def _value_pass(self, batch: RolloutBatch, plans: list[StepPlan]) -> dict[int, torch.Tensor]:
        """The values of this rank's samples by position; ranks that do not answer for their
        replica (Megatron's other TP and pipeline ranks) may return none."""
        raise NotImplementedError

    def _value_step(
        self, batch: RolloutBatch, step: StepPlan, old: dict[int, torch.Tensor], ret: dict[int, torch.Tensor]
    ) -> tuple[dict[str, float], float]:
        """One optimizer step; its metrics, and this rank's largest |step forward - value pass|
        over the loss mask (--check-precision's gate reads the first step's)."""
        raise NotImplementedError

    def _check_batch(self, batch: RolloutBatch) -> None:
        batch.validate(self.hf_config.get_text_config().vocab_size)
        if any(batch.multimodal_train_inputs or ()):
            raise BatchError(
                "PPO's critic on samples with images is not built (its forward takes no pixels): use "
                "--advantage-estimator grpo (or another critic-free one) with images"
            )

    # ---- values -----------------------------------------------------------------------------
    @torch.no_grad()
    def compute_values(self, data: RolloutBatch | RolloutPart) -> PerSample:
        """The value of every response token of this rank's samples, keyed by sample index (the
        job merges the answers of a data-parallel replica's ranks)."""
        part = RolloutPart.of(data)
        batch = part.batch
        self._check_batch(batch)
        out = self._value_pass(batch, self._log_prob_plans(part, self.plan(part)))
        index = batch.sample_indices or part.positions
        return {index[p]: v.tolist() for p, v in out.items()}

    # ---- training ---------------------------------------------------------------------------
    def train_values(
        self, rollout_id: int, data: RolloutBatch | RolloutPart, old_values: PerSample, returns: PerSample
    ) -> TrainOutput:
        """Optimizer steps of the clipped value loss; `old_values` (from `compute_values`) and
        `returns` are keyed by sample index and must cover this rank's samples."""
        part = RolloutPart.of(data)
        batch = part.batch
        self._check_batch(batch)
        index = batch.sample_indices or part.positions
        plans = self.plan(part)
        mine = [p for step in plans for mb in step.micro_batches for p in mb]
        self._raise_agreed(
            self._missing(batch, mine, index, old_values, "values")
            or self._missing(batch, mine, index, returns, "returns")
        )
        old = {p: torch.tensor(old_values[index[p]], dtype=torch.float32) for p in mine}
        ret = {p: torch.tensor(returns[index[p]], dtype=torch.float32) for p in mine}
        output = TrainOutput()
        start = time.perf_counter()
        output.rollout.update(self._value_metrics(batch, mine, old, ret))
        if self.cfg.optimizer.reset_optimizer_states:
            reset_states(self.optimizer)
        for k, step in enumerate(plans):
            metrics, gap = self._value_step(batch, step, old, ret)
            output.steps.append(metrics)
            if k == 0 and self.cfg.check_precision:  # --check-precision's gate (slime.debug.precision)
                output.precision["critic_first_step_max_abs_diff"] = self._max_over_ranks(gap)
        output.timings["train"] = time.perf_counter() - start
        self.rollout_id = rollout_id
        return output

    @classmethod
    def _missing(
        cls, batch: RolloutBatch, mine: list[int], index: list[int], per_sample: PerSample, what: str
    ) -> str | None:
        p = cls._uncovered(batch, mine, index, per_sample)
        if p is None:
            return None
        got = f"{len(per_sample[index[p]])}" if index[p] in per_sample else "none"
        return f"sample {index[p]}: {got} {what} for its {batch.response_lengths[p]} response tokens"

    def _value_metrics(
        self, batch: RolloutBatch, mine: list[int], old: dict[int, torch.Tensor], ret: dict[int, torch.Tensor]
    ) -> dict[str, float]:
        """Token means over the loss mask, over the replicas (one rank of each counts): the values
        and returns, and the explained variance of the returns by the values."""
        masks = [self._loss_mask(batch, p) for p in mine]
        stats = adv.explained_variance([old[p] for p in mine], [ret[p] for p in mine], masks)
        sums = torch.zeros(3, dtype=torch.float64)
        for p, m in zip(mine, masks):
            sums += torch.stack([(old[p] * m).sum().double(), (ret[p] * m).sum().double(), m.sum().double()])
        reduced = torch.cat([stats, sums]) * float(self.writes_train_data)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(reduced)
        count = float(reduced[7]) or 1.0
        out = {"values": float(reduced[5]) / count, "returns": float(reduced[6]) / count}
        explained = adv.explained_variance_of(reduced[:5])
        if not math.isnan(explained):  # undefined when every return is the same (no reward yet)
            out["explained_variance"] = explained
        return out

    def _value_loss(
        self,
        step: StepPlan,
        mb: MicroBatch,
        values: torch.Tensor,
        old: dict[int, torch.Tensor],
        ret: dict[int, torch.Tensor],
        sums: dict[str, torch.Tensor],
    ) -> tuple[torch.Tensor, float]:
        """A micro-batch's share of the step's value loss from its `values` ([batch, max
        response], with grad), its metric sums added to `sums`, and its largest |values - V_old|
        over the loss mask: on the weights of the value pass the step's forward gives its values
        bitwise unless kernels, dropout or other micro-batches change the bits (the critic's
        ppo_kl == 0)."""
        dev = values.device
        old_values = mb.response_tensor([old[p] for p in mb.positions]).to(dev)
        gaps = (values.detach() - old_values).abs()[mb.loss_mask.to(dev).bool()]
        gap = float(gaps.double().max()) if gaps.numel() else 0.0
        weights = token_weights(
            mb.loss_mask,
            self.cfg.loss.calculate_per_token_loss,
            step.num_executions,
            step.num_tokens,
            step.row_denominators(mb.positions),
        ).to(dev)
        returns = mb.response_tensor([ret[p] for p in mb.positions]).to(dev)
        loss, clipped = value_loss(values, old_values, returns, self.cfg.loss.value_clip)
        total = weighted_sum(loss, weights)
        sums["value_loss"] += total.detach().double().cpu()
        sums["value_clipfrac"] += weighted_sum(clipped, weights).detach().double().cpu()
        return total, gap

    # ---- what a critic does not do ----------------------------------------------------------
    def train(
        self,
        rollout_id: int,
        data: RolloutBatch | RolloutPart,
        values: dict[int, list[float]] | None = None,
        update: bool = True,
    ) -> TrainOutput:
        raise NotImplementedError("a critic trains with train_values(rollout_id, data, old_values, returns)")

    def export_weights(self, bucket_bytes: int, every_rank: bool = False) -> Any:
        raise NotImplementedError("a critic's weights never go to the engines")
