"""The critic of PPO (`--advantage-estimator ppo`) on FSDP: the value model (a backend,
slime.backends.interface.ValueBackend) and the critic over it (slime.backends.value.ValueTrainer,
what every backend's critic does).

The value model is Hugging Face's *ForTokenClassification with `num_labels` 1 on the actor's
transformer: its `score` head is slime's value head. A checkpoint without that head (the actor's)
gets slime.backends.value.fresh_value_head; a critic checkpoint's own head is read like
any parameter.
"""

from __future__ import annotations

import torch

from slime.backends.fsdp import model_init
from slime.backends.fsdp.actor import FSDPBackend
from slime.backends.fsdp.forward import response_values
from slime.backends.interface import PerPosition, ValueLoss
from slime.backends.value import ValueTrainer, fresh_value_head, value_model_config
from slime.utils import transfer
from slime.utils.rollout_batch import RolloutBatch
from slime.utils.step_plans import StepPlan


class FSDPValueModel(FSDPBackend):
    """The FSDP backend with a value head instead of the LM head (module docstring)."""

    value_head = True

    def _fresh_parameters(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return fresh_value_head(self.hf_config, self.cfg.seed)

    @torch.no_grad()
    def value_pass(self, batch: RolloutBatch, plans: list[StepPlan]) -> PerPosition:
        values = transfer.RowsToHost()
        self.model.eval()
        try:
            for step in plans:
                for positions in step.micro_batches:
                    mb = self._micro_batch(batch, positions)
                    values.add(response_values(self.model, mb), mb.positions, mb.response_lengths)
        finally:
            self.model.train()
        model_init.reshard(self.model)
        return values.collect()

    def value_step(self, batch: RolloutBatch, step: StepPlan, loss: ValueLoss) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, torch.Tensor] = {}
        for positions in step.micro_batches:
            mb = self._micro_batch(batch, positions)
            with self._routing_state(mb, None, aux=self._aux_coeff > 0) as state:
                total = loss(mb, response_values(self.model, mb), sums)
                self._with_aux_loss(total, state, mb, step, sums).backward()
        return self._optimizer_step(sums)

    def save_hf(self, path: str) -> None:
        """A Hugging Face token classifier (slime.backends.value.value_model_config):
        `--critic-load` takes it back."""
        actor_config = self.hf_config
        self.hf_config = value_model_config(actor_config)
        try:
            super().save_hf(path)
        finally:
            self.hf_config = actor_config


class FSDPCritic(ValueTrainer[FSDPValueModel]):
    """PPO's critic on one FSDP rank."""

    backend_class = FSDPValueModel
