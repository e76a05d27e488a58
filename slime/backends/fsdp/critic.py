"""The critic of PPO (`--advantage-estimator ppo`) on FSDP (what every backend's critic does:
slime.backends.critic_common).

The value model is Hugging Face's *ForTokenClassification with `num_labels` 1 on the actor's
transformer: its `score` head is slime's value head. A checkpoint without that head (the actor's)
gets slime.backends.critic_common.fresh_value_head; a critic checkpoint's own head is read like
any parameter.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from slime.backends.critic_common import ValueModel, fresh_value_head, value_model_config
from slime.backends.fsdp import model_init
from slime.backends.fsdp.actor import FSDPTrainActor
from slime.backends.fsdp.forward import response_values
from slime.backends.train_records import nan_max
from slime.utils.batch import RolloutBatch
from slime.utils.batching import StepPlan


class FSDPCritic(ValueModel, FSDPTrainActor):
    """A value model on FSDP ranks (module docstring)."""

    def _fresh_parameters(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return fresh_value_head(self.hf_config, self.cfg.seed)

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

    def _value_step(
        self, batch: RolloutBatch, step: StepPlan, old: dict[int, torch.Tensor], ret: dict[int, torch.Tensor]
    ) -> tuple[dict[str, float], float]:
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64))
        gap = 0.0
        for positions in step.micro_batches:
            mb = self._micro_batch(batch, positions)
            with self._routing_state(mb, aux=self._aux_coeff > 0) as state:
                total, mb_gap = self._value_loss(step, mb, response_values(self.model, mb), old, ret, sums)
                gap = nan_max(gap, mb_gap)
                self._with_aux_loss(total, state, mb, step, sums).backward()
        return self._optimizer_step(sums), gap

    def save_hf(self, path: str) -> None:
        """A Hugging Face token classifier (slime.backends.critic_common.value_model_config):
        `--critic-load` takes it back."""
        actor_config = self.hf_config
        self.hf_config = value_model_config(actor_config)
        try:
            super().save_hf(path)
        finally:
            self.hf_config = actor_config
