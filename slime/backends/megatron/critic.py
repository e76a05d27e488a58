"""The critic of PPO (`--advantage-estimator ppo`) on megatron-core: the value model (a backend,
slime.backends.interface.ValueBackend) and the critic over it (slime.backends.value.ValueTrainer,
what every backend's critic does).

The value model is the actor's GPTModel with its output layer replaced, on the last pipeline
stage, by a value head (`ValueHead`: hidden -> 1 with a bias, replicated over TP), as slime's
Megatron critic does; megatron-core's GPTModel then returns one value per position. The model is
never tied: its embedding is its own, whatever the checkpoint's tie_word_embeddings says (a
token classifier has no LM head to tie).

It starts from `--critic-load` or the actor's checkpoint: the trunk is converted like the actor's
(slime.backends.megatron.convert, without an output layer), the head is the checkpoint's `score`
(a critic's --save-hf export) or slime.backends.value.fresh_value_head. Its `--save`
checkpoints are the actor's layout with the head as `output_layer.weight` [1, hidden] and
`output_layer.bias` [1] (marked `value_head` in the args: the conversion tools refuse them); its
--save-hf export is a Hugging Face token classifier, as the FSDP critic's.

Values are read on the last stage, one replica rank (TP rank 0 of the last stage) answering for
its replica; the loss runs on the last stage (megatron-core's pipeline schedule carries the
gradient back).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from slime.backends.interface import PerPosition, ValueLoss
from slime.backends.megatron import checkpoint as mckpt
from slime.backends.megatron import train_checkpoint
from slime.backends.megatron.actor import MegatronBackend
from slime.backends.megatron.convert import ConversionError, Layout, State
from slime.backends.micro_batch import MicroBatch
from slime.backends.value import HEAD_NAMES, ValueTrainer, fresh_value_head, value_model_config
from slime.utils.rollout_batch import RolloutBatch
from slime.utils.step_plans import StepPlan


class ValueHead(torch.nn.Module):
    """The critic's output layer, in the place of GPTModel's `output_layer` (called like it:
    `(hidden, weight=..., runtime_gather_output=...) -> (output, bias)`; the model returns the
    output as [batch, sequence, 1]). Its weight and bias are whole on every TP rank.

    With sequence parallelism each TP rank holds a slice of the sequence: the head runs on its
    slice and the values are gathered along the sequence. Every TP rank then computes the same
    loss from the same values, so the gather's backward keeps each rank's slice of the gradient
    (no sum, megatron-core's `tensor_parallel_output_grad=False`), and the head's gradients, each
    from its rank's slice, are summed over the TP group like the norms' (marked
    `sequence_parallel`: slime.backends.megatron.grads)."""

    def __init__(self, hidden_size: int, sequence_parallel: bool = False, tp_group: Any = None):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1, hidden_size))
        self.bias = torch.nn.Parameter(torch.zeros(1))
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group
        if sequence_parallel:
            for p in (self.weight, self.bias):
                p.sequence_parallel = True  # type: ignore[attr-defined]

    def forward(
        self, hidden: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
    ) -> tuple[torch.Tensor, None]:
        values = torch.nn.functional.linear(hidden, self.weight, self.bias).float()
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            values = gather_from_sequence_parallel_region(values, False, self.tp_group)
        return values, None


class MegatronValueModel(MegatronBackend):
    """The Megatron backend with a value head as its output layer (module docstring)."""

    value_head = True

    def _model_layout(self) -> Layout:
        return dataclasses.replace(super()._model_layout(), tied_embeddings=False, mtp_layers=0)

    def _build_gpt(self, config: Any) -> Any:
        model = super()._build_gpt(config)
        # megatron-core built the vocabulary's output layer (on the GPU with CUDA: transient memory
        # until it is dropped here).
        if self.last_stage:
            model.output_layer = ValueHead(
                self.layout.hidden_size, self.cfg.megatron.sequence_parallel, self.mesh.tp_group
            )
        return model

    def _load_hf(self, hf_dir: str) -> None:
        head = self._head(hf_dir)  # checked on every rank: none waits for a stage that failed
        state = self._read_hf_shard(hf_dir, lm_head=False)
        if self.last_stage:
            state.update(head)
        self.copy_in(state, masters=True)

    def _head(self, hf_dir: str) -> State:
        """The checkpoint's value head (a critic's export), a fresh one, or
        both (a checkpoint with a weight and no bias); megatron-core's names."""
        hf = mckpt.LazyHFState(hf_dir)
        # What the checkpoint lacks is fresh, as on FSDP: a reward model's `score` has no bias.
        head = {
            **fresh_value_head(self.hf_config, self.cfg.seed),
            **{n: hf[n] for n in HEAD_NAMES if n in hf},
        }
        shapes = {"score.weight": (1, self.layout.hidden_size), "score.bias": (1,)}
        wrong = [
            f"{n} {tuple(head[n].shape)}" for n, shape in shapes.items() if tuple(head[n].shape) != shape
        ]
        if wrong:
            raise ConversionError(
                f"the critic's checkpoint {hf_dir!r} (--critic-load, else --hf-checkpoint): its value head "
                f"has {', '.join(wrong)}; a critic's head is score.weight [1, {self.layout.hidden_size}] "
                "and score.bias [1] (a token classifier with num_labels 1)"
            )
        return {"output_layer.weight": head["score.weight"], "output_layer.bias": head["score.bias"]}

    # ---- values -----------------------------------------------------------------------------
    @staticmethod
    def _response_values(output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        """[batch, max response] values from the model's [rows, tokens, 1] output (token t's
        value at position t - 1, as its log-prob)."""
        if mb.cp is not None:  # context parallelism: the local predictions' values, gathered as log-probs are
            from slime.backends.megatron.context_parallel import cp_response_stats

            return cp_response_stats(mb, lambda index, _targets: (output[0, index, 0].float(), None))[0]
        rows, cols, _ = mb.predictions()
        return mb.scatter(output[rows, cols, 0].float())

    @torch.no_grad()
    def value_pass(self, batch: RolloutBatch, plans: list[StepPlan]) -> PerPosition:
        """TP rank 0 of the last stage answers for the replica; the other ranks return nothing."""
        mbs = self._micro_batches(batch, plans)
        out = self._collect(mbs, self._response_values, self._routing_states(mbs, None))
        return out if self.writes_train_data else {}

    # ---- training ---------------------------------------------------------------------------
    def value_step(self, batch: RolloutBatch, step: StepPlan, loss: ValueLoss) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        sums: dict[str, torch.Tensor] = {}

        def loss_fn(mb: MicroBatch, output: torch.Tensor) -> torch.Tensor:
            return loss(mb, self._response_values(output, mb), sums)

        mbs = self._micro_batches(batch, [step])
        states = self._routing_states(mbs, None, step=step)  # --moe-aux-loss-coeff's aux loss, as the actor's
        self._run(mbs, loss_fn, forward_only=False, routing=states)
        return {**self._optimizer_step(sums), **self._aux_metrics(states)}

    # ---- export -----------------------------------------------------------------------------
    def save_hf(self, path: str) -> None:
        """A Hugging Face token classifier (slime.backends.value.value_model_config), as
        the FSDP critic's: `--critic-load` takes it back. Every rank takes part."""
        from slime.backends.megatron.export import export_hf_tensors

        local = {n: t.detach() for n, t in self.model_state().items() if not n.startswith("output_layer.")}
        # The trunk is exported like a tied actor's: no output layer.
        trunk = list(
            export_hf_tensors(local, dataclasses.replace(self.layout, tied_embeddings=True), self.mesh)
        )
        head = self._head_from_last_stage()
        train_checkpoint.save_hf_from_actor(
            self, path, tensors=trunk + list(head.items()), config=value_model_config(self.hf_config)
        )

    def _head_from_last_stage(self) -> State:
        """The head's weight and bias on every stage (collective over the pipeline group)."""
        h = self.layout.hidden_size
        if self.last_stage:
            head = self.model.output_layer
            flat = torch.cat([head.weight.detach().reshape(-1), head.bias.detach()]).float().to(self.device)
        else:
            flat = torch.empty(h + 1, device=self.device)
        if self.pp > 1:
            from megatron.core import parallel_state as ps

            dist.broadcast(flat, src=ps.get_pipeline_model_parallel_last_rank(), group=self.mesh.pp_group)
        flat = flat.cpu()
        return {"score.weight": flat[:h].reshape(1, h).clone(), "score.bias": flat[h:].clone()}


class MegatronCritic(ValueTrainer[MegatronValueModel]):
    """PPO's critic on one Megatron rank."""

    backend_class = MegatronValueModel
