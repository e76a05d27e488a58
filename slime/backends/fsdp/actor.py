"""The FSDP2 backend: one data-parallel rank's model, its forward passes and optimizer step
(slime.backends.interface.TrainBackend); `FSDPTrainActor` is the policy over it.

Losses are reduced over the *global* batch (see slime.algo.losses.token_weights) and FSDP
sums gradients across ranks instead of averaging them, so N ranks compute the same gradient
as one rank given the same global batch. Every rank receives the whole rollout and derives
the same plan from it; the only collectives are FSDP's own, the all-reduces of metrics and
whitening statistics, and the gradient-norm reduction.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from slime.backends import hf_checkpoint, startup
from slime.backends.expert_bias import TokenCounts
from slime.backends.fsdp import checkpoint as ckpt
from slime.backends.fsdp import compiled, lora, model_init, moe, vision
from slime.backends.fsdp.forward import response_log_probs
from slime.backends.interface import MicroBatchLoss, Pass, PassResult, PerPosition, State
from slime.backends.measures import add_to, sum_over_ranks
from slime.backends.micro_batch import MicroBatch, make_micro_batch
from slime.backends.optim import LRSchedule, freeze_parameters, make_optimizer, move_model, state_bytes
from slime.backends.planning import packs_sequences
from slime.backends.policy import PolicyTrainer
from slime.backends.routing import real_token_index
from slime.backends.weight_copies import reference
from slime.config.train import TrainConfig
from slime.utils import hf_experts, model_families, transfer
from slime.utils.distributed import init_train_group, leave_train_group
from slime.utils.rollout_batch import RolloutBatch
from slime.utils.step_plans import StepPlan
from slime.utils.transfer import to_device

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class FSDPBackend:
    """Implements slime.backends.interface.TrainBackend with torch FSDP2 (fully_shard)."""

    routing: moe.Routing | None
    value_head = False
    """A value model (slime.backends.fsdp.critic) instead of the causal LM."""
    dp_group: Any = None  # the default group: every rank is a replica of its own
    context_parallel = 1
    writes_train_data = True
    ref_state: State | None = None
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
        self.rank = 0
        self.world_size = 1
        # Set by init().
        self.model: Any = None
        self.optimizer: torch.optim.Optimizer
        self.schedule: LRSchedule
        self.hf_config: Any = None
        self.resumed_extra: dict[str, Any] = {}  # the `extra` of the checkpoint resumed from

    # ---- set-up -----------------------------------------------------------------------------
    def init(self) -> dict[str, Any]:
        cfg = self.cfg
        self.hf_config = startup.check_files(cfg)
        self.rank, self.world_size = init_train_group(
            cfg.device, *self._dist_args, timeout_minutes=cfg.distributed_timeout_minutes
        )
        self.dp_rank, self.dp_size = self.rank, self.world_size
        cfg.batch.check_layout(self.world_size)
        if cfg.fsdp.disable_sharding and self.world_size != 1:
            raise ValueError(
                f"--debug-disable-sharding runs one unsharded rank, but the job has {self.world_size} "
                "train ranks: use --actor-num-nodes 1 --actor-num-gpus-per-node 1"
            )
        self.device = startup.seed_device(cfg)
        self.model = self._build_model()
        self.routing = self._install_routing()
        self.bias_counts = self._install_bias_counts()
        freeze_parameters(self.model, cfg.optimizer, strict=not self.value_head)
        vision.set_up_vision_tower(self.model, cfg.fsdp.train_vision_model)
        # With LoRA only the adapters train (PEFT froze the rest): the optimizer holds them alone.
        self.optimizer = make_optimizer(
            [p for p in self.model.parameters() if p.requires_grad], cfg.optimizer
        )
        self.schedule = LRSchedule(self.optimizer, cfg.optimizer)
        if cfg.loss.needs_ref and not cfg.lora.enabled:  # LoRA's reference: the adapters off
            if cfg.ref_load and cfg.ref_load != cfg.hf_checkpoint:
                self.ref_state = model_init.read_local_shards(
                    self.model, cfg.ref_load, self.rank, self.world_size
                )
            else:
                self.ref_state = self.snapshot()
        if cfg.opd.in_train:  # the teacher must have the student's parameters (names and shapes)
            assert cfg.opd.teacher_load is not None
            self.teacher_state = model_init.read_local_shards(
                self.model, cfg.opd.teacher_load, self.rank, self.world_size
            )
        resumed = None
        if cfg.load:
            resumed = self.load(cfg.load)
        return startup.ready("FSDP", self, resumed)

    def _build_model(self) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        fsdp = self.cfg.fsdp
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        # --attention-dropout (0 unless given) replaces the checkpoint's; HF drops in train() mode only.
        self.hf_config.attention_dropout = self.cfg.model.attention_dropout
        model = model_init.build_meta_model(self.hf_config, self._attention(), self.value_head)
        if self.cfg.lora.enabled:
            model = lora.inject(model, self.cfg.lora)
        if fsdp.gradient_checkpointing:
            # transformers >= 5 renamed the method; the non-reentrant variant works under FSDP2.
            enable = getattr(model, "activation_checkpointing_enable", None)
            if enable is not None:
                enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        mp = MixedPrecisionPolicy(
            param_dtype=_DTYPES[fsdp.param_dtype], reduce_dtype=_DTYPES[fsdp.reduce_dtype]
        )
        offload = CPUOffloadPolicy() if fsdp.cpu_offload else None
        model = model_init.shard_model(model, mesh, self.device, mp, offload, shard=not fsdp.disable_sharding)
        if fsdp.torch_compile:
            compiled.compile_layers(model_init.decoder_layers(model))
        if fsdp.disable_sharding:
            logger.warning("--debug-disable-sharding: training the plain module on one rank (no FSDP)")
        shards = model_init.read_local_shards(
            model,
            self.cfg.hf_checkpoint,
            self.rank,
            self.world_size,
            self._fresh_parameters(model),
            lora.checkpoint_name,
        )
        model_init.copy_into_shards(model, shards)
        del shards
        model_init.load_buffers(model, self.cfg.hf_checkpoint)
        # Each rank's loss is its share of the global mean: gradients must be summed, not
        # averaged. A plain SUM (no pre/post division) is also the only reduction gloo has.
        for module in model_init.fsdp_modules(model):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
        model.train()
        return model

    def _fresh_parameters(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Whole tensors for parameters the checkpoint may lack: LoRA's adapters (fresh, or from
        --lora-adapter-path), a critic's new value head."""
        lo = self.cfg.lora
        if not lo.enabled:
            return None
        return (
            lora.read_adapter(lo.adapter_path, model, lo)
            if lo.adapter_path
            else lora.fresh_adapters(model, self.cfg.seed)
        )

    @property
    def packs_sequences(self) -> bool:
        return packs_sequences(self.cfg, self.hf_config)

    def reference_weights(self) -> contextlib.AbstractContextManager[None]:
        """The reference's weights (--ref-load, else the start's); with LoRA the base model, the
        adapters switched off (no second copy)."""
        return self._adapters_off() if self.cfg.lora.enabled else reference(self)

    @contextlib.contextmanager
    def _adapters_off(self) -> Iterator[None]:
        lora.set_adapters_enabled(self.model, False)
        try:
            yield
        finally:
            lora.set_adapters_enabled(self.model, True)

    def _install_routing(self) -> moe.Routing | None:
        """The router hooks of a mixture-of-experts model (slime.backends.fsdp.moe); a MoE flag
        with a dense model is refused by name."""
        layers = model_init.decoder_layers(self.model)
        if not hf_experts.find_routers(layers):
            flag = self.cfg.moe.needs_moe
            if flag:
                raise hf_checkpoint.CheckpointError(
                    f"{flag} needs a mixture-of-experts model; --hf-checkpoint {self.cfg.hf_checkpoint} "
                    f"({self.hf_config.model_type}) has no routed experts"
                )
            return None
        why = model_families.refusal(self.hf_config.model_type, "router_hooks")
        if why:  # a family whose routers the hooks do not follow (refused at parse time too)
            fp32 = model_families.routes_in_fp32(self.hf_config.model_type, self.cfg.fsdp.param_dtype)
            flag = self.cfg.moe.needs_router_hooks(router_fp32=fp32)
            if flag:
                raise hf_checkpoint.CheckpointError(f"{flag}: {why}")
            return None
        return moe.Routing(layers, self.cfg.moe.moe_router_dtype)

    def _install_bias_counts(self) -> TokenCounts | None:
        """--moe-router-bias-update-rate > 0: count each router's real training tokens per expert
        (slime.backends.expert_bias); refused by name for a model whose routers have no bias."""
        rate = self.cfg.moe.moe_router_bias_update_rate
        if rate == 0:
            return None
        counts = TokenCounts.find(self.model)
        if counts is None:
            raise hf_checkpoint.CheckpointError(
                self.cfg.moe.no_expert_bias(
                    f"--hf-checkpoint {self.cfg.hf_checkpoint} ({self.hf_config.model_type})"
                )
            )
        return counts

    def _routing_state(
        self, mb: MicroBatch, replay: PerPosition | None, record: bool = False, aux: bool = False
    ) -> Any:
        """The router hooks' state for micro-batch `mb`, replaying `replay`'s routing (a null
        context for a dense model)."""
        if self.routing is None:
            return contextlib.nullcontext(None)
        rows = None
        if replay is not None:
            rows = self.routing.replay_rows(replay, mb.positions, mb.token_starts(), mb.input_ids.numel())
            rows = to_device(rows, self.device)
        return self.routing.micro_batch(rows, record=record, aux=aux)

    @property
    def _aux_coeff(self) -> float:
        """--moe-aux-loss-coeff where the model has routers (0 otherwise)."""
        return self.cfg.moe.aux_loss_coeff if self.routing is not None else 0.0

    def _with_aux_loss(
        self, loss: torch.Tensor, state: Any, mb: MicroBatch, step: StepPlan, sums: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """`loss` plus --moe-aux-loss-coeff x megatron-core's aux_loss of this micro-batch (the
        routing `state` captured it), weighted by its share of the step's samples (so
        micro-batches of one sample give the same loss however the step is split over ranks)."""
        if self._aux_coeff == 0 or self.routing is None:
            return loss
        ids = mb.sample_ids(torch.device("cpu"))
        real = real_token_index(ids)
        real_on_device = to_device(real, self.device)
        if self.cfg.moe.per_sequence:  # seq_aux_loss: each sample's own, over the step's samples
            samples = to_device(ids[real], self.device)
            aux = self.routing.aux_loss(state, real_on_device, samples, mb.num_samples) / step.num_samples
        else:
            aux = self.routing.aux_loss(state, real_on_device) * (mb.num_samples / step.num_samples)
        add_to(sums, "moe_aux_loss", aux)
        return loss + self._aux_coeff * aux

    def local_state_bytes(self) -> int:
        """Bytes of this rank's parameter shards plus optimizer states."""
        params = sum(model_init.local_tensor(p).numel() * p.element_size() for p in self.model.parameters())
        return params + state_bytes(self.optimizer, model_init.local_tensor)

    def _attention(self) -> str:
        """--attn-implementation, except that packed micro-batches with the default (sdpa) run
        slime.backends.packed_attention: sdpa would mask the whole packed row (docs/train.md)."""
        name = self.cfg.fsdp.attn_implementation
        if self.packs_sequences and name == "sdpa":
            from slime.backends.packed_attention import register

            name = register()
        logger.info("attention: %s (%s micro-batches)", name, "packed" if self.packs_sequences else "padded")
        return name

    def _micro_batch(self, batch: RolloutBatch, positions: list[int]) -> MicroBatch:
        mb = make_micro_batch(
            positions,
            batch.tokens,
            batch.response_lengths,
            batch.loss_masks,
            self.device,
            self.packs_sequences,
        )
        vision.attach_images(self.model, mb, batch)
        return mb

    # ---- log-probs --------------------------------------------------------------------------
    @torch.no_grad()
    def log_prob_pass(self, batch: RolloutBatch, plans: list[StepPlan], how: Pass) -> PassResult:
        result = PassResult({})
        record = how.record and self.routing is not None
        if record:
            result.routing = {}
        log_probs_down, entropy_down = transfer.RowsToHost(), transfer.RowsToHost(torch.float32)
        recorded: list[tuple[MicroBatch, transfer.HostCopy]] = []  # R2's routing, on its way down
        self.model.eval()  # no dropout in log-prob passes (--attention-dropout acts in training steps)
        try:
            for step in plans:
                for positions in step.micro_batches:
                    mb = self._micro_batch(batch, positions)
                    with self._routing_state(mb, how.replay, record=record) as state:
                        log_probs, entropy = response_log_probs(
                            self.model,
                            mb,
                            self.cfg.rollout_temperature,
                            how.entropy,
                            self.cfg.batch.log_probs_chunk_size,
                        )
                    if result.routing is not None:
                        assert self.routing is not None
                        table = self.routing.recorded(state, mb.input_ids.numel(), self.device)
                        recorded.append((mb, transfer.to_host_async(table)))
                    log_probs_down.add(log_probs, mb.positions, mb.response_lengths)
                    if entropy is not None:
                        entropy_down.add(entropy, mb.positions, mb.response_lengths)
        finally:
            self.model.train()
        model_init.reshard(self.model)
        for mb, copy in recorded:
            assert result.routing is not None
            routed = copy.wait()
            for start, p in zip(mb.token_starts(), mb.positions):
                result.routing[p] = routed[start : start + len(batch.tokens[p])].clone()
        result.log_probs = log_probs_down.collect()
        if how.entropy:
            result.entropy = entropy_down.collect()
        return result

    def snapshot(self) -> State:
        return model_init.snapshot_shards(self.model)

    def copy_in(self, state: State) -> None:
        model_init.copy_into_shards(self.model, state)

    def train_step(
        self, batch: RolloutBatch, step: StepPlan, loss: MicroBatchLoss, replay: PerPosition | None
    ) -> dict[str, float]:
        cfg = self.cfg
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, torch.Tensor] = {}
        for positions in step.micro_batches:
            mb = self._micro_batch(batch, positions)
            if self.bias_counts is not None:
                self.bias_counts.begin(mb.real_tokens())
            with self._routing_state(mb, replay, aux=self._aux_coeff > 0) as state:
                log_probs, entropy = response_log_probs(
                    self.model, mb, cfg.rollout_temperature, True, cfg.batch.log_probs_chunk_size
                )
                assert entropy is not None
                total = self._with_aux_loss(loss(mb, log_probs, entropy, sums), state, mb, step, sums)
                total.backward()
            if self.bias_counts is not None:
                self.bias_counts.end()
        return self._optimizer_step(sums)

    def _optimizer_step(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Clip, step the optimizer and the schedule; the step's metrics summed over the ranks,
        with grad_norm and the learning rate the step used."""
        grad_norm = self._clip_gradients()
        lr = self.schedule.lr
        self.optimizer.step()
        self.schedule.step()
        if self.bias_counts is not None:
            self.bias_counts.step(self.cfg.moe.moe_router_bias_update_rate)
        result = sum_over_ranks(sums)
        result.update(grad_norm=grad_norm, lr=lr)
        return result

    def _clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.cfg.optimizer.clip_grad or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        full = getattr(norm, "full_tensor", None)
        return float(full() if full is not None else norm)

    # ---- checkpoints and weights ------------------------------------------------------------
    def save(self, rollout_id: int, path: str, extra: dict[str, Any] | None = None) -> str:
        return ckpt.save_checkpoint(self, rollout_id, path, extra)

    def load(self, path: str) -> int | None:
        return ckpt.load_checkpoint(self, path)

    def save_hf(self, path: str) -> None:
        """A Hugging Face directory; with LoRA a PEFT adapter directory (PeftModel.from_pretrained
        on --hf-checkpoint loads it; --lora-adapter-path starts from it), and with
        --lora-save-merged the merged model in its `merged/` (written after the adapter)."""
        if self.cfg.lora.enabled:
            named, config = self.export_adapter()
            if self.rank == 0:
                from slime.utils.peft_files import write_adapter_dir

                write_adapter_dir(path, config, dict(named))
            dist.barrier()
            if self.cfg.lora.save_merged:
                ckpt.save_hf_checkpoint(self, os.path.join(path, "merged"), merge=self._merge_adapters)
        else:
            ckpt.save_hf_checkpoint(self, path)

    def export_weights(
        self, bucket_bytes: int, every_rank: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Full tensors on every rank anyway; with LoRA the base weights with the adapters merged."""
        merge = self._merge_adapters if self.cfg.lora.enabled else None
        return ckpt.export_weight_buckets(self.model, bucket_bytes, merge=merge)

    def export_adapter(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        """LoRA: the adapters as full tensors under PEFT's names, and their PEFT config (every
        rank takes part; --lora-push adapter sends them)."""
        config = lora.adapter_config_dict(lora.injected_config(self.model), self.cfg.hf_checkpoint)
        return lora.full_adapters(self.model), config

    def _merge_adapters(
        self, named: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return lora.merged(named, self.cfg.lora.scaling, lora.adapted(self.model))

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {
            lora.checkpoint_name(name): tuple(p.shape)
            for name, p in self.model.named_parameters()
            if not lora.is_adapter(name)
        }
        return hf_experts.checkpoint_shapes(self.hf_config.model_type, shapes)

    # ---- colocation -------------------------------------------------------------------------
    def sleep(self, keep_params: bool = False) -> None:
        if self.device.type != "cpu":
            move_model(self.model, self.optimizer, "cpu", params=not keep_params)

    def wake(self) -> None:
        if self.device.type != "cpu":
            move_model(self.model, self.optimizer, self.device)

    def close(self) -> None:
        leave_train_group()


class FSDPTrainActor(PolicyTrainer[FSDPBackend]):
    """The policy on one FSDP rank (slime.backends.interface.TrainActor)."""

    backend_class = FSDPBackend
