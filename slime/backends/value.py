"""The critic of PPO (`--advantage-estimator ppo`), what it does the same way on every train
backend (the value models: slime.backends.fsdp.critic, slime.backends.megatron.critic).

The value model is the actor's transformer with a one-output linear head (slime's value head, a
hidden -> 1 linear with a bias; Hugging Face's *ForTokenClassification `score` head with
`num_labels` 1). A checkpoint without that head (the actor's, slime's default start) gets a fresh
one, `fresh_value_head`: the same on every rank and on both backends.

Per rollout the critic does two things, on the data-parallel layout of the actor's train ranks
(slime.backends.planning: the same planning, micro-batches and token weights):

- `compute_values`: the value of every response token (read at the position before it, where
  the token's log-prob is predicted), before this rollout's update: the baseline of GAE and the
  V_old of the clipped value loss;
- `train_values`: optimizer steps on the clipped value loss (slime.algo.losses.value_loss)
  against the returns the advantages came with, reduced like the policy loss (per sample, or
  per token with --calculate-per-token-loss).

`ValueTrainer` does both over a backend's value model (slime.backends.interface.ValueBackend:
its `value_pass` and its `value_step`, given the loss of a micro-batch, `ValueLossOf`).
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any, TypeVar

import torch

from slime.algo import advantages as adv
from slime.algo.losses import value_loss, weighted_sum
from slime.backends import measures, planning
from slime.backends.interface import PerPosition, ValueBackend
from slime.backends.measures import DeviceMax, add_to, loss_mask, step_weights
from slime.backends.micro_batch import MicroBatch
from slime.backends.optim import reset_states
from slime.backends.trainer import RankTrainer
from slime.config.loss import LossConfig
from slime.utils.rollout_batch import BatchError, RolloutBatch, RolloutPart, TrainOutput
from slime.utils.step_plans import StepPlan
from slime.utils.transfer import to_device

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


class ValueLossOf:
    """The clipped value loss of one optimizer step's micro-batches (a ValueLoss) against the
    `returns`, with `old` the value pass's values (V_old). It keeps the largest |values - V_old|
    over the loss mask in `worst`: on the weights of the value pass the step's forward gives its
    values bitwise unless kernels, dropout or other micro-batches change the bits (the critic's
    ppo_kl == 0)."""

    def __init__(self, cfg: LossConfig, step: StepPlan, old: PerPosition, returns: PerPosition):
        self.cfg, self.step, self.old, self.returns = cfg, step, old, returns
        self.worst = DeviceMax()

    def __call__(self, mb: MicroBatch, values: torch.Tensor, sums: dict[str, torch.Tensor]) -> torch.Tensor:
        dev, step = values.device, self.step
        old_values = mb.laid_out(self.old, dev)
        self.worst.add(values, old_values, to_device(mb.loss_mask, dev))
        weights = step_weights(mb, step, self.cfg.calculate_per_token_loss, dev)
        returns = mb.laid_out(self.returns, dev)
        loss, clipped = value_loss(values, old_values, returns, self.cfg.value_clip)
        total = weighted_sum(loss, weights)
        add_to(sums, "value_loss", total)
        add_to(sums, "value_clipfrac", weighted_sum(clipped, weights))
        return total


V = TypeVar("V", bound=ValueBackend)


class ValueTrainer(RankTrainer[V]):
    """PPO's critic on one train rank, over a backend's value model (module docstring)."""

    def _check_batch(self, batch: RolloutBatch) -> None:
        self.check_vocabulary(batch)
        if any(batch.multimodal_train_inputs or ()):
            raise BatchError(
                "PPO's critic on samples with images is not built (its forward takes no pixels): use "
                "--advantage-estimator grpo (or another critic-free one) with images"
            )

    @torch.no_grad()
    def compute_values(self, data: RolloutBatch | RolloutPart) -> PerSample:
        """The value of every response token of this rank's samples, keyed by sample index (the
        job merges the answers of a data-parallel replica's ranks)."""
        part = RolloutPart.of(data)
        batch = part.batch
        self._check_batch(batch)
        out = self.backend.value_pass(batch, self.log_prob_plans(part, self.plan(part)))
        index = batch.sample_indices or part.positions
        return {index[p]: v.tolist() for p, v in out.items()}

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
        mine = planning.positions(plans)
        measures.raise_agreed(
            _missing(batch, mine, index, old_values, "values")
            or _missing(batch, mine, index, returns, "returns")
        )
        old = {p: torch.tensor(old_values[index[p]], dtype=torch.float32) for p in mine}
        ret = {p: torch.tensor(returns[index[p]], dtype=torch.float32) for p in mine}
        output = TrainOutput()
        start = time.perf_counter()
        output.rollout.update(self._value_metrics(batch, mine, old, ret))
        if self.cfg.optimizer.reset_optimizer_states:
            reset_states(self.backend.optimizer)
        for k, step in enumerate(plans):
            loss = ValueLossOf(self.cfg.loss, step, old, ret)
            output.steps.append(self.backend.value_step(batch, step, loss))
            if k == 0 and self.cfg.check_precision:  # --check-precision's gate (slime.debug.precision)
                output.precision["critic_first_step_max_abs_diff"] = measures.max_over_ranks(loss.worst.value)
        output.timings["train"] = time.perf_counter() - start
        return output

    def _value_metrics(
        self, batch: RolloutBatch, mine: list[int], old: PerPosition, ret: PerPosition
    ) -> dict[str, float]:
        """Token means over the loss mask, over the replicas (one rank of each counts): the values
        and returns, and the explained variance of the returns by the values."""
        masks = [loss_mask(batch, p) for p in mine]
        stats = adv.explained_variance([old[p] for p in mine], [ret[p] for p in mine], masks)
        sums = torch.zeros(3, dtype=torch.float64)
        for p, m in zip(mine, masks):
            sums += torch.stack([(old[p] * m).sum().double(), (ret[p] * m).sum().double(), m.sum().double()])
        reduced = torch.cat([stats, sums]) * float(self.backend.writes_train_data)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(reduced)
        count = float(reduced[7]) or 1.0
        out = {"values": float(reduced[5]) / count, "returns": float(reduced[6]) / count}
        explained = adv.explained_variance_of(reduced[:5])
        if not math.isnan(explained):  # undefined when every return is the same (no reward yet)
            out["explained_variance"] = explained
        return out


def _missing(
    batch: RolloutBatch, mine: list[int], index: list[int], per_sample: PerSample, what: str
) -> str | None:
    p = measures.uncovered(batch, mine, index, per_sample)
    if p is None:
        return None
    got = f"{len(per_sample[index[p]])}" if index[p] in per_sample else "none"
    return f"sample {index[p]}: {got} {what} for its {batch.response_lengths[p]} response tokens"
