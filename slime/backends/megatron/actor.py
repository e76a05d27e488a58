"""The Megatron-core backend: one rank of a TP x PP x DP layout (slime.backends.interface.
TrainBackend); `MegatronTrainActor` is the policy over it.

megatron-core supplies the parallel state, the GPTModel (this rank's TP shard of its stage's
layers) and the pipeline schedules; slime supplies the step (slime.backends.policy), the loss
(slime.algo), the optimizer (the same AdamW and schedule) and the gradient reduction and clipping
(slime.backends.megatron.grads). Log-probs are computed on the last stage from the
vocabulary-parallel logits (slime.backends.megatron.logprobs) and broadcast to the other stages.
On `--device cpu` megatron-core runs through slime.backends.megatron.cpu_shim.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from slime.backends import startup
from slime.backends.interface import MicroBatchLoss, Pass, PassResult, PerPosition
from slime.backends.measures import sum_over_ranks
from slime.backends.megatron import checkpoint as mckpt
from slime.backends.megatron import grads, lora, mtp, settings, train_checkpoint, weights_out
from slime.backends.megatron.context_parallel import run_micro_batch
from slime.backends.megatron.convert import Layout, State
from slime.backends.megatron.export import Mesh
from slime.backends.megatron.logprobs import from_last_stage, response_log_probs
from slime.backends.megatron.masters import MasterWeights, copy_in, snapshot
from slime.backends.megatron.model import model_state, move_rotary_tables
from slime.backends.megatron.moe import MegatronRouting, MicroBatchRouting
from slime.backends.megatron.sharding import hf_to_megatron_shard
from slime.backends.micro_batch import MicroBatch, make_micro_batch
from slime.backends.optim import LRSchedule, freeze_parameters, make_optimizer, move_model, state_bytes
from slime.backends.planning import packs_sequences
from slime.backends.policy import PolicyTrainer
from slime.backends.weight_copies import reference
from slime.config.train import TrainConfig
from slime.utils import model_families, transfer
from slime.utils.distributed import init_train_group, leave_train_group
from slime.utils.rollout_batch import RolloutBatch
from slime.utils.step_plans import StepPlan


class MegatronBackend:
    """Implements slime.backends.interface.TrainBackend with megatron-core."""

    routing: MegatronRouting | None
    value_head = False  # a PPO critic's output layer is its value head (slime.backends.megatron.critic)
    writes_train_data = True
    ref_state: State | None = None
    lora: lora.MegatronLoRA | None = None
    teacher_state: State | None = None

    def __init__(
        self,
        cfg: TrainConfig,
        rank: int | None = None,
        world_size: int | None = None,
        init_method: str | None = None,
    ):
        self.cfg = cfg
        self._dist_args = (rank, world_size, init_method)
        self.rank, self.world_size = 0, 1
        self.model: Any = None
        self.masters = MasterWeights()  # --bf16: parameter -> float32 master weight
        self.resumed_extra: dict[str, Any] = {}

    # ---- set-up -----------------------------------------------------------------------------
    def init(self) -> dict[str, Any]:
        cfg, m = self.cfg, self.cfg.megatron
        # a released Qwen3.5 checkpoint: its language model (checkpoint.as_stored: its names)
        self.hf_config = model_families.text_config(startup.check_files(cfg))
        unsupported = settings.check_supported(m)
        if unsupported:
            raise ValueError(unsupported)
        self.layout = self._model_layout()
        self.tp, self.pp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size
        self.ep, self.etp = m.expert_model_parallel_size, m.etp
        self.layout.check_parallel(self.tp, self.pp, self.ep, self.etp)
        unsupported = settings.check_moe(m, self.layout, cfg.moe)
        if unsupported:
            raise ValueError(unsupported)
        self.rank, self.world_size = init_train_group(
            cfg.device, *self._dist_args, timeout_minutes=cfg.distributed_timeout_minutes
        )
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
            context_parallel_size=m.context_parallel_size,
        )
        self.mesh = Mesh.from_parallel_state()
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        self.dp_group = ps.get_data_parallel_group()
        # context parallelism (context_parallel.py): (size, rank, group); gradients summed over DP x CP
        self.cp_rank, cp = ps.get_context_parallel_rank(), m.context_parallel_size
        self._cp = (cp, self.cp_rank, ps.get_context_parallel_group()) if cp > 1 else None
        self.context_parallel, dpcp = cp, ps.get_data_parallel_group(with_context_parallel=True)
        self.grad_group = dpcp if self.dp_size * cp > 1 else None
        self.first_stage, self.last_stage = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        # One rank per replica writes the replica's files and counts its step metrics.
        self.writes_train_data = self.last_stage and self.mesh.tp_rank == 0 and self.cp_rank == 0
        cfg.batch.check_layout(self.dp_size)
        self.device = startup.seed_device(cfg)
        self.model, self.config = self._build_model()
        self.routing = MegatronRouting.install(
            self.model,
            self.layout,
            self.hf_config,
            settings.recompute_settings(cfg),
            self.mesh,
            m.sequence_parallel,
        )
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self._forward_backward = get_forward_backward_func()
        freeze_parameters(self.model, cfg.optimizer, strict=not self.value_head)
        trained = [p for p in self.model.parameters() if p.requires_grad]
        if m.bf16:
            self.masters = MasterWeights.attach(trained)
        self._load_hf(cfg.hf_checkpoint)
        self.optimizer = make_optimizer(list(self.masters.values()) or trained, cfg.optimizer)
        self.schedule = LRSchedule(self.optimizer, cfg.optimizer)
        if cfg.loss.needs_ref and self.lora is None:  # (LoRA's reference: the adapters off)
            ref_dir = cfg.ref_load or cfg.hf_checkpoint
            self.ref_state = (
                self.snapshot()
                if ref_dir == cfg.hf_checkpoint
                else self._read_hf_shard(ref_dir, own_mtp=True)
            )
        if cfg.opd.in_train:  # the teacher must have the student's architecture
            assert cfg.opd.teacher_load is not None
            self.teacher_state = self._read_hf_shard(cfg.opd.teacher_load, own_mtp=True)
        resumed = self.load(cfg.load) if cfg.load else None
        return startup.ready("Megatron", self, resumed, tp=self.tp, pp=self.pp)

    def _model_layout(self) -> Layout:
        m = self.cfg.megatron
        return Layout.from_hf_config(
            self.hf_config,
            m.make_vocab_size_divisible_by,
            m.transformer_impl == "transformer_engine",
            m.stage_layers,
            m.mtp_num_layers or 0,
        )

    def _build_model(self) -> tuple[Any, Any]:
        from megatron.core import tensor_parallel

        from slime.backends.megatron.model import transformer_config

        m = self.cfg.megatron
        on_cpu = self.device.type == "cpu"
        if not on_cpu:
            tensor_parallel.model_parallel_cuda_manual_seed(self.cfg.seed)
        dtype = torch.bfloat16 if m.bf16 else torch.float32
        config = transformer_config(
            self.layout, self.hf_config, dtype, **settings.transformer_settings(self.cfg, on_cpu)
        )
        if on_cpu:
            from megatron.core import parallel_state

            from slime.backends.megatron import cpu_shim

            cpu_shim.enable()
            cpu_shim.seed(
                self.cfg.seed,
                parallel_state.get_tensor_model_parallel_rank(),
                self.mesh.ep_rank,
                self.mesh.etp_rank,
            )
        model = self._build_gpt(config)
        if self.layout.mtp_layers:  # trained (--enable-mtp-training) or kept as loaded
            mtp.attach(model, self.layout, self.mesh, m.enable_mtp_training, self._cp and self._cp[2])
        self.lora = lora.build(self.cfg, self.layout, self.hf_config, self.mesh, model)
        if m.bf16:  # megatron-core's torch norms keep float32 weights: Float16Module's cast, done here
            model.bfloat16()
        if not on_cpu:
            model.cuda(torch.cuda.current_device())
        model.train()
        return model, config

    def _build_gpt(self, config: Any) -> Any:
        """This rank's GPTModel, before `_build_model` casts it (--bf16) and moves it to the GPU."""
        from slime.backends.megatron.model import build_gpt_model

        return build_gpt_model(self.layout, self.hf_config, config, self.tp)

    def _routing_states(
        self,
        mbs: list[MicroBatch],
        replay: PerPosition | None,
        record: bool = False,
        step: StepPlan | None = None,
    ) -> list[MicroBatchRouting | None]:
        """The router hooks' state for each micro-batch, replaying `replay`'s routing (`step`: a
        training step's, with the aux loss)."""
        if self.routing is None:
            return [None] * len(mbs)
        aux = self.cfg.moe.aux_loss_coeff if step is not None else 0.0
        samples = step.num_samples if step is not None else 0
        return self.routing.states(mbs, replay, record, aux, samples, self.cfg.moe.per_sequence)

    def _read_hf_shard(self, hf_dir: str, lm_head: bool = True, own_mtp: bool = False) -> State:
        """This rank's megatron-core shard of an HF checkpoint: only its stage's tensors are read,
        one layer at a time (without `lm_head`: no output layer, the critic has its own; `own_mtp`:
        the MTP modules from this model, not the checkpoint, for the passes that never run them)."""
        mesh, layout = self.mesh, mtp.without_modules(self.layout) if own_mtp else self.layout
        state = hf_to_megatron_shard(
            mckpt.LazyHFState(hf_dir),
            layout,
            self.tp,
            self.pp,
            mesh.tp_rank,
            mesh.pp_rank,
            self.ep,
            self.etp,
            mesh.ep_rank,
            mesh.etp_rank,
            lm_head,
        )
        return {**state, **mtp.module_state(self.model)} if own_mtp else state

    def _load_hf(self, hf_dir: str) -> None:
        initial = self.lora.initial if self.lora is not None else {}  # (not the checkpoint's)
        self.copy_in({**self._read_hf_shard(hf_dir), **initial}, masters=True)

    def copy_in(self, state: State, masters: bool = False) -> None:
        """`state` into the model (with `masters`, --bf16's master weights too: masters.copy_in)."""
        copy_in(self.model, self.masters if masters else None, state)

    def snapshot(self) -> State:
        return snapshot(self.model)

    def reference_weights(self) -> contextlib.AbstractContextManager[None]:
        return self.lora.off() if self.lora is not None else reference(self)

    @property
    def packs_sequences(self) -> bool:
        return packs_sequences(self.cfg, self.hf_config)

    def local_state_bytes(self) -> int:
        params = sum(p.numel() * p.element_size() for p in self.model.parameters())
        return params + self.masters.nbytes() + state_bytes(self.optimizer)

    # ---- forward ----------------------------------------------------------------------------
    def _micro_batch(self, batch: RolloutBatch, positions: list[int]) -> MicroBatch:
        # Sequence parallelism splits the sequence over TP ranks: its length must divide by TP (the
        # padding a segment of its own when packed; after a sample, out of its logits, when padded).
        multiple = self.tp if self.cfg.megatron.sequence_parallel else 1
        return make_micro_batch(
            positions,
            batch.tokens,
            batch.response_lengths,
            batch.loss_masks,
            self.device,
            self.packs_sequences,
            multiple,
        )

    def _response_log_probs(
        self, logits: torch.Tensor, mb: MicroBatch, with_entropy: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, max_response] log-probs (and entropy) from this rank's vocabulary columns."""
        c = self.cfg
        vocab, chunk = self.layout.vocab_size, c.batch.log_probs_chunk_size
        return response_log_probs(logits, mb, vocab, self.mesh, c.rollout_temperature, chunk, with_entropy)

    def _run(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: Any,
        forward_only: bool,
        routing: list[MicroBatchRouting | None] | None = None,
    ) -> None:
        """megatron-core's schedule over the micro-batches; `loss_fn(mb, logits)` runs on the
        last stage and returns the micro-batch's loss (a share of the global loss). `routing`:
        the router hooks' state of each micro-batch."""
        if not micro_batches:
            return
        model = self.model
        states = routing or [None] * len(micro_batches)

        def forward_step(data: Iterator[tuple[MicroBatch, Any]], _model: Any) -> tuple[torch.Tensor, Any]:
            mb, state = next(data)
            if self.routing is not None:
                self.routing.begin(state)
            extra: dict[str, Any] = {}
            if not forward_only and mtp.objective(model) is not None:  # the MTP loss's targets (mtp.py)
                extra.update(labels=mb.input_ids, loss_mask=mtp.token_loss_mask(mb))
            scatter = self.cfg.megatron.sequence_parallel and self.mesh.pp_rank > 0
            output = run_micro_batch(
                model,
                mb,
                extra,
                self._bias_rate > 0,
                scatter,
                self._cp,
                self.cfg.megatron.transformer_impl == "local",
            )

            def loss_func(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
                return loss_fn(mb, logits), torch.tensor(1, dtype=torch.int), {}

            return output, loss_func

        longest = max(mb.input_ids.shape[1] for mb in micro_batches)
        try:
            self._forward_backward(
                forward_step_func=forward_step,
                data_iterator=iter(zip(micro_batches, states)),
                model=[model],
                num_microbatches=len(micro_batches),
                seq_length=longest,
                micro_batch_size=max(mb.input_ids.shape[0] for mb in micro_batches),
                forward_only=forward_only,
            )
        except BaseException:
            if self.routing is not None:
                self.routing.end_pass(completed=False)
            raise
        if self.routing is not None:
            self.routing.end_pass()

    # ---- log-probs --------------------------------------------------------------------------
    def _micro_batches(self, batch: RolloutBatch, plans: list[StepPlan]) -> list[MicroBatch]:
        return [self._micro_batch(batch, pos) for step in plans for pos in step.micro_batches if pos]

    def _collect(
        self, mbs: list[MicroBatch], per_token: Any, states: list[MicroBatchRouting | None]
    ) -> dict[int, torch.Tensor]:
        """A forward-only pass in eval mode; on the last stage `per_token(output, mb)` gives each
        micro-batch's [batch, max response] values, kept per sample position (other stages: none),
        brought to the host in one copy after the pass."""
        down = transfer.RowsToHost()

        def collect(mb: MicroBatch, output: torch.Tensor) -> torch.Tensor:
            down.add(per_token(output, mb), mb.positions, mb.response_lengths)
            return torch.zeros((), device=output.device)

        self.model.eval()
        try:
            self._run(mbs, collect, forward_only=True, routing=states)
        finally:
            self.model.train()
        return down.collect()

    @torch.no_grad()
    def log_prob_pass(self, batch: RolloutBatch, plans: list[StepPlan], how: Pass) -> PassResult:
        mbs = self._micro_batches(batch, plans)
        record = how.record
        states = self._routing_states(mbs, how.replay, record=record)
        want = how.entropy  # --use-rollout-entropy: [log-prob, entropy] per token
        result = PassResult({}, {} if want else None, {} if record and self.routing is not None else None)

        def per_token(logits: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
            log_probs, entropy = self._response_log_probs(logits, mb, want)
            return log_probs if entropy is None else torch.stack((log_probs, entropy), -1)

        out = self._collect(mbs, per_token, states)
        if result.routing is not None:  # R2: each stage keeps its own layers' routing
            assert self.routing is not None
            for mb, routed in zip(mbs, self.routing.recorded(mbs, states)):
                for start, p in zip(mb.token_starts(), mb.positions):
                    result.routing[p] = routed[start : start + len(batch.tokens[p])].clone()
        if self.pp > 1:  # the last stage's values, to every stage
            positions = [p for mb in mbs for p in mb.positions]
            sizes = [batch.response_lengths[p] * (1 + want) for p in positions]
            flat = {p: v.reshape(-1) for p, v in out.items()}
            out = from_last_stage(flat, positions, sizes, self.last_stage, self.device, self.mesh.pp_group)
        if result.entropy is not None:
            result.entropy.update({p: v.reshape(-1, 2)[:, 1].clone() for p, v in out.items()})
            out = {p: v.reshape(-1, 2)[:, 0].clone() for p, v in out.items()}
        result.log_probs = out
        return result

    # ---- training ---------------------------------------------------------------------------
    def train_step(
        self, batch: RolloutBatch, step: StepPlan, loss: MicroBatchLoss, replay: PerPosition | None
    ) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        sums: dict[str, torch.Tensor] = {}

        def loss_fn(mb: MicroBatch, logits: torch.Tensor) -> torch.Tensor:
            log_probs, entropy = self._response_log_probs(logits, mb, True)
            assert entropy is not None
            return loss(mb, log_probs, entropy, sums)

        mbs = self._micro_batches(batch, [step])
        states = self._routing_states(mbs, replay, step=step)
        objective = mtp.begin_step(
            self.model,
            mbs,
            self.cfg.megatron.mtp_loss_scaling_factor,
            self.dp_group if self.dp_size > 1 else None,
            self.device,
        )
        self._run(mbs, loss_fn, forward_only=False, routing=states)
        if objective is not None:
            sums.update(objective.end())
        return {**self._optimizer_step(sums), **self._aux_metrics(states)}

    def _aux_metrics(self, states: list[MicroBatchRouting | None]) -> dict[str, float]:
        """A training step's moe_aux_loss (with --moe-aux-loss-coeff): every stage has its own MoE
        layers, one rank of each stage's TP group counts them."""
        if self.cfg.moe.aux_loss_coeff == 0 or self.routing is None:
            return {}
        aux = torch.tensor(float(sum(s.aux_sum for s in states if s is not None)), dtype=torch.float64)
        return sum_over_ranks({"moe_aux_loss": aux}, contribute=self.mesh.tp_rank == 0)

    def _optimizer_step(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Reduce and clip the gradients, step the optimizer and the schedule (and the routers'
        expert bias: slime.backends.megatron.grads.optimizer_step); the step's metric sums over
        the replicas (one rank of each, last stage and TP rank 0, contributes; the others join
        with zeros), with grad_norm and the learning rate the step used."""
        grad_norm, lr = grads.optimizer_step(
            self.model,
            self.mesh,
            self.layout,
            self.grad_group,
            self.masters,
            self.device,
            self.optimizer,
            self.schedule,
            self.cfg.optimizer.clip_grad,
            self._bias_rate,
        )
        result = sum_over_ranks(sums, contribute=self.writes_train_data)
        result.update(grad_norm=grad_norm, lr=lr)
        return result

    @property
    def _bias_rate(self) -> float:
        """--moe-router-bias-update-rate where the routers have an expert bias (0 otherwise)."""
        return self.cfg.moe.moe_router_bias_update_rate if self.layout.expert_bias else 0.0

    # ---- checkpoints and weights ------------------------------------------------------------
    def model_state(self) -> State:
        return model_state(self.model)

    def save(self, rollout_id: int, path: str, extra: dict[str, Any] | None = None) -> str:
        return train_checkpoint.save_train_checkpoint(self, rollout_id, path, extra)

    def load(self, path: str) -> int | None:
        return train_checkpoint.load_train_checkpoint(self, path)

    def save_hf(self, path: str) -> None:
        weights_out.save_hf(self, path)

    def export_weights(
        self, bucket_bytes: int, every_rank: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return weights_out.export_weights(self, bucket_bytes, every_rank)

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return weights_out.weight_shapes(self)

    def export_adapter(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        return weights_out.export_adapter(self)

    # ---- colocation -------------------------------------------------------------------------
    def sleep(self, keep_params: bool = False) -> None:
        self._move("cpu", params=not keep_params)

    def wake(self) -> None:
        self._move(self.device)

    def _move(self, device: str | torch.device, params: bool = True) -> None:
        """The model and optimizer states (slime.backends.optim.move_model), the --bf16 masters
        and their gradients (optimizer side: they move whatever `params` says; the optimizer
        holds these very tensors), megatron-core's rotary tables and its attention scratch buffer
        (freed on sleep, allocated again on use). A no-op on --device cpu."""
        if self.device.type == "cpu":
            return
        self.masters.move(device)
        move_rotary_tables(self.model, device)
        if torch.device(device).type == "cpu":
            from megatron.core import parallel_state as ps

            ps.get_global_memory_buffer().buffer.clear()
        move_model(self.model, self.optimizer, device, params)

    def close(self) -> None:
        from megatron.core import parallel_state as ps

        leave_train_group(ps.destroy_model_parallel)


class MegatronTrainActor(PolicyTrainer[MegatronBackend]):
    """The policy on one Megatron rank (slime.backends.interface.TrainActor)."""

    backend_class = MegatronBackend
