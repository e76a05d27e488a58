"""The critic of PPO (`--advantage-estimator ppo`) on FSDP: a value model trained on the returns.

The value model is the actor's transformer with a one-output linear head: Hugging Face's
*ForTokenClassification with `num_labels` 1, whose `score` head is slime's value head (a
hidden -> 1 linear with a bias). A checkpoint without that head (the actor's, slime's default
start) gets a fresh one, N(0, initializer_range) weights and a zero bias, drawn from --seed so
every rank builds the same; a critic checkpoint's own head is read like any parameter.

Per rollout the critic does two things, on the data-parallel layout of the actor's train ranks
(slime.backends.train_common: the same planning, micro-batches and token weights):

- `compute_values`: the value of every response token (read at the position before it,
  slime.backends.fsdp.forward.response_values), before this rollout's update: the baseline of
  GAE and the V_old of the clipped value loss;
- `train_values`: optimizer steps on the clipped value loss (slime.algo.losses.value_loss)
  against the returns the advantages came with, reduced like the policy loss (per sample, or
  per token with --calculate-per-token-loss).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Any

import torch

from slime.algo import advantages as adv
from slime.algo.losses import token_weights, value_loss, weighted_sum
from slime.backends.fsdp import model_init
from slime.backends.fsdp.actor import FSDPTrainActor
from slime.backends.fsdp.forward import response_values
from slime.backends.interface import RolloutBatch, RolloutPart, TrainOutput
from slime.backends.train_common import StepPlan, as_part, nan_max

PerSample = dict[int, list[float]]


class FSDPCritic(FSDPTrainActor):
    """A value model on FSDP ranks (module docstring)."""

    value_head = True

    def _fresh_parameters(self) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.cfg.seed)
        std = float(getattr(self.hf_config, "initializer_range", 0.02))
        hidden = int(self.hf_config.hidden_size)
        return {"score.weight": torch.randn(1, hidden, generator=g) * std, "score.bias": torch.zeros(1)}

    # ---- values -----------------------------------------------------------------------------
    @torch.no_grad()
    def compute_values(self, data: RolloutBatch | RolloutPart) -> PerSample:
        """The value of every response token of this rank's samples, keyed by sample index."""
        part = as_part(data)
        batch = part.batch
        batch.validate(self.hf_config.vocab_size)
        out = self._value_pass(batch, self._log_prob_plans(part, self.plan(part)))
        index = batch.sample_indices or part.positions
        return {index[p]: v.tolist() for p, v in out.items()}

    def _value_pass(self, batch: RolloutBatch, plans: list[StepPlan]) -> dict[int, torch.Tensor]:
        out: dict[int, torch.Tensor] = {}
        self.model.eval()
        try:
            for step in plans:
                for positions in step.micro_batches:
                    mb = self._micro_batch(batch, positions)
                    values = response_values(self.model, mb).cpu()
                    for row, p in enumerate(mb.positions):
                        out[p] = values[row, : mb.response_lengths[row]].clone()
        finally:
            self.model.train()
        model_init.reshard(self.model)
        return out

    # ---- training ---------------------------------------------------------------------------
    def train_values(
        self, rollout_id: int, data: RolloutBatch | RolloutPart, old_values: PerSample, returns: PerSample
    ) -> TrainOutput:
        """Optimizer steps of the clipped value loss; `old_values` (from `compute_values`) and
        `returns` are keyed by sample index and must cover this rank's samples."""
        part = as_part(data)
        batch = part.batch
        batch.validate(self.hf_config.vocab_size)
        index = batch.sample_indices or part.positions
        plans = self.plan(part)
        mine = [p for step in plans for mb in step.micro_batches for p in mb]
        self._raise_agreed(self._missing(batch, mine, index, old_values, "values")
                           or self._missing(batch, mine, index, returns, "returns"))  # fmt: skip
        old = {p: torch.tensor(old_values[index[p]], dtype=torch.float32) for p in mine}
        ret = {p: torch.tensor(returns[index[p]], dtype=torch.float32) for p in mine}
        output = TrainOutput()
        start = time.perf_counter()
        output.rollout.update(self._value_metrics(batch, mine, old, ret))
        for k, step in enumerate(plans):
            metrics, gap = self._value_step(batch, step, old, ret)
            output.steps.append(metrics)
            if k == 0 and self.cfg.check_precision:  # --check-precision's gate (slime.debug.precision)
                output.precision["critic_first_step_max_abs_diff"] = self._max_over_ranks(gap)
        output.timings["train"] = time.perf_counter() - start
        self.rollout_id = rollout_id
        return output

    @classmethod
    def _missing(cls, batch: RolloutBatch, mine: list[int], index: list[int], per_sample: PerSample,
                 what: str) -> str | None:  # fmt: skip
        p = cls._uncovered(batch, mine, index, per_sample)
        if p is None:
            return None
        got = f"{len(per_sample[index[p]])}" if index[p] in per_sample else "none"
        return f"sample {index[p]}: {got} {what} for its {batch.response_lengths[p]} response tokens"

    def _value_metrics(self, batch: RolloutBatch, mine: list[int], old: dict[int, torch.Tensor],
                       ret: dict[int, torch.Tensor]) -> dict[str, float]:  # fmt: skip
        """Token means over the loss mask, over all ranks: the values and returns, and the
        explained variance of the returns by the values."""
        masks = [self._loss_mask(batch, p) for p in mine]
        stats = adv.explained_variance([old[p] for p in mine], [ret[p] for p in mine], masks)
        sums = torch.zeros(3, dtype=torch.float64)
        for p, m in zip(mine, masks):
            sums += torch.stack([(old[p] * m).sum().double(), (ret[p] * m).sum().double(), m.sum().double()])
        reduced = torch.cat([stats, sums])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(reduced)
        count = float(reduced[7]) or 1.0
        out = {"values": float(reduced[5]) / count, "returns": float(reduced[6]) / count}
        explained = adv.explained_variance_of(reduced[:5])
        if not math.isnan(explained):  # undefined when every return is the same (no reward yet)
            out["explained_variance"] = explained
        return out

    def _value_step(self, batch: RolloutBatch, step: StepPlan, old: dict[int, torch.Tensor],
                    ret: dict[int, torch.Tensor]) -> tuple[dict[str, float], float]:  # fmt: skip
        """One optimizer step; its metrics, and this rank's largest |step forward - value pass|
        over the loss mask (--check-precision's gate reads the first step's)."""
        cfg = self.cfg
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        gap = 0.0
        for positions in step.micro_batches:
            mb = self._micro_batch(batch, positions)
            dev = mb.input_ids.device
            values = response_values(self.model, mb)
            old_values = mb.response_tensor([old[p] for p in mb.positions]).to(dev)
            # The step's forward against the value pass, on the same weights: bitwise equal unless
            # kernels, dropout or other micro-batches change the bits (PPO's ppo_kl == 0 for the critic).
            gaps = (values.detach() - old_values).abs()[mb.loss_mask.to(dev).bool()]
            if gaps.numel():
                gap = nan_max(gap, float(gaps.double().max()))
            weights = token_weights(mb.loss_mask, cfg.loss.calculate_per_token_loss, step.num_samples,
                                    step.num_tokens).to(dev)  # fmt: skip
            loss, clipped = value_loss(values, old_values, mb.response_tensor([ret[p] for p in mb.positions]).to(dev),
                                       cfg.loss.value_clip)  # fmt: skip
            total = weighted_sum(loss, weights)
            sums["value_loss"] += total.detach().double().cpu()
            sums["value_clipfrac"] += weighted_sum(clipped, weights).detach().double().cpu()
            total.backward()
        return self._optimizer_step(sums), gap

    def save_hf(self, path: str) -> None:
        """A Hugging Face directory AutoModelForTokenClassification loads (config with one label and
        the token-classification architecture): `--critic-load` takes it back."""
        import copy

        actor_config = self.hf_config
        config = copy.deepcopy(actor_config)
        config.num_labels, config.classifier_dropout = 1, 0.0
        config.architectures = [
            a.replace("ForCausalLM", "ForTokenClassification") for a in config.architectures or []
        ]
        self.hf_config = config
        try:
            super().save_hf(path)
        finally:
            self.hf_config = actor_config

    # ---- what a critic does not do ----------------------------------------------------------
    def train(
        self, rollout_id: int, data: RolloutBatch | RolloutPart, values: Any = None, update: bool = True
    ) -> Any:
        raise NotImplementedError("a critic trains with train_values(rollout_id, data, old_values, returns)")

    def export_weights(self, bucket_bytes: int, every_rank: bool = False) -> Any:
        raise NotImplementedError("a critic's weights never go to the engines")
