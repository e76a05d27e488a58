"""The policy's train step, the same on every backend, over its data-parallel ranks.

A rank belongs to one data-parallel replica (`dp_rank` of `dp_size`); the ranks of a replica
(Megatron's tensor- and pipeline-parallel peers) see the same samples and hold the same
log-probs, advantages and metrics. Per rollout `PolicyTrainer.train` plans the optimizer steps
and micro-batches (slime.backends.planning), runs the log-prob passes (the old policy's, the
reference's, the OPD teacher's), computes the advantages, then asks the backend for each
optimizer step with the loss of a micro-batch (`PolicyLoss`). It reaches the model only through
the backend's protocol (slime.backends.interface.TrainBackend); the backend's forward, backward
and optimizer step are its own.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from slime.algo import advantages as adv
from slime.algo.losses import approx_kl
from slime.algo.objective import MicroBatchTerms, micro_batch_loss
from slime.algo.plugins import LossHooks, Ragged
from slime.backends import measures, perf, planning
from slime.backends.interface import Pass, PerPosition
from slime.backends.measures import DeviceMax, TokenValues, add_to, loss_mask, step_weights
from slime.backends.micro_batch import MicroBatch
from slime.backends.optim import reset_states
from slime.backends.profiler import TrainProfiler
from slime.backends.trainer import B, RankTrainer
from slime.backends.weight_copies import KeptWeights, swapped
from slime.config.loss import LossConfig
from slime.utils.errors import UsageError
from slime.utils.rollout_batch import BatchError, RolloutBatch, RolloutPart, TrainOutput
from slime.utils.step_plans import StepPlan
from slime.utils.transfer import to_device


class PolicyLoss:
    """The policy's loss of one optimizer step's micro-batches (a MicroBatchLoss): each
    micro-batch's share of the step's loss from its forward's log-probs and entropy and the
    rollout's values (slime.algo.objective). With `compare` (the log-prob pass's values,
    --check-precision) it keeps the largest |compare - forward| over the loss mask in `worst`."""

    def __init__(
        self,
        cfg: LossConfig,
        hooks: LossHooks | None,
        batch: RolloutBatch,
        step: StepPlan,
        values: TokenValues,
        compare: PerPosition | None = None,
    ):
        self.cfg, self.hooks, self.batch, self.step = cfg, hooks, batch, step
        self.values, self.compare = values, compare
        self.worst = DeviceMax()

    def __call__(
        self, mb: MicroBatch, log_probs: torch.Tensor, entropy: torch.Tensor, sums: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        cfg, step, v = self.cfg, self.step, self.values
        dev = log_probs.device
        mask = to_device(mb.loss_mask, dev)
        if self.compare is not None:
            self.worst.add(mb.laid_out(self.compare, dev), log_probs, mask)

        def lay_out(per_sample: Any) -> torch.Tensor | None:
            return None if per_sample is None else mb.laid_out(per_sample, dev)

        rollout = lay_out(self.batch.rollout_log_probs)
        weights = step_weights(mb, step, cfg.calculate_per_token_loss, dev)
        totals = [p + r for p, r in zip(mb.prompt_lengths, mb.response_lengths)]
        terms = MicroBatchTerms(
            log_probs=log_probs,
            mask=mask,
            weights=weights,
            old_log_probs=lay_out(v.old),
            advantages=lay_out(v.advantages),
            ref_log_probs=lay_out(v.ref),
            rollout_log_probs=rollout,
            entropy=entropy if cfg.entropy_coef != 0 else entropy.detach(),
            ragged=Ragged(list(mb.response_lengths), totals),
            normaliser=float(step.num_tokens if cfg.calculate_per_token_loss else step.num_executions),
        )
        loss, metrics = micro_batch_loss(cfg, terms, self.hooks)
        for name, value in metrics.items():
            add_to(sums, name, value)
        return loss


class PolicyTrainer(RankTrainer[B]):
    """The policy on one train rank (implements slime.backends.interface.TrainActor)."""

    @functools.cached_property
    def kept(self) -> KeptWeights:
        """--keep-old-actor: the weights of the versions pushed."""
        return KeptWeights(self.backend)

    @functools.cached_property
    def step_perf(self) -> perf.StepPerf:
        """The perf/* metrics' FLOPs count and peak (--peak-tflops), made at the first train call."""
        b = self.backend
        return perf.StepPerf(b.hf_config, b.device, self.cfg.peak_tflops, b.rank)

    @functools.cached_property
    def profiler(self) -> TrainProfiler:
        """--use-pytorch-profiler (a no-op without it)."""
        return TrainProfiler(self.cfg.profile, self.backend.device.type, self.backend.rank)

    @functools.cached_property
    def loss_hooks(self) -> LossHooks | None:
        """slime's loss hooks (--custom-tis-function-path, --custom-pg-loss-reducer-function-path)."""
        loss = self.cfg.loss
        return LossHooks.load(
            loss.custom_tis_function_path, loss.custom_pg_loss_reducer_function_path, self.cfg.plugin_args
        )

    # ---- weights ----------------------------------------------------------------------------
    def keep_weights(self, version: str) -> None:
        """--keep-old-actor: the weights about to be pushed as `version`, kept on the host."""
        self.kept.keep(version)

    def export_weights(
        self, bucket_bytes: int, every_rank: bool = False
    ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        return self.backend.export_weights(bucket_bytes, every_rank)

    @property
    def pushes_adapter(self) -> bool:
        """--lora-push adapter: a push sends the adapter alone (slime.bridge.adapter)."""
        return self.cfg.lora.pushes_adapter

    def export_adapter(self) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
        return self.backend.export_adapter()

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        return self.backend.weight_shapes()

    @contextlib.contextmanager
    def _teacher_weights(self) -> Iterator[None]:
        """Context: the OPD teacher's weights are in the model (--opd-type megatron)."""
        assert self.backend.teacher_state is not None
        with swapped(self.backend, self.backend.teacher_state):
            yield

    # ---- log-probs --------------------------------------------------------------------------
    def _replay(self, batch: RolloutBatch, mine: list[int]) -> PerPosition | None:
        """R3's routing tables (the engine's routing of the samples at `mine`, checked)."""
        if not self.cfg.moe.use_rollout_routing_replay:
            return None
        if self.backend.routing is None:  # the backends refuse the flag with a dense model at start-up
            raise UsageError("--use-rollout-routing-replay needs a mixture-of-experts model")
        return self.backend.routing.rollout_tables(batch, mine)

    def compute_log_probs(
        self, data: RolloutBatch | RolloutPart, use_reference: bool = False
    ) -> dict[int, list[float]]:
        """Log-probs of this rank's share of the response tokens, keyed by sample index."""
        part = RolloutPart.of(data)
        batch = part.batch
        self.check_vocabulary(batch)
        plans = self.log_prob_plans(part, self.plan(part))
        how = Pass(replay=self._replay(batch, planning.positions(plans)))
        weights = self.backend.reference_weights() if use_reference else contextlib.nullcontext()
        with weights:
            values = self.backend.log_prob_pass(batch, plans, how).log_probs
        index = batch.sample_indices or part.positions
        return {index[p]: v.tolist() for p, v in values.items()}

    def _log_probs(
        self,
        part: RolloutPart,
        plans: list[StepPlan],
        mine: list[int],
        v: TokenValues,
        clock: perf.PassClock,
        replay: PerPosition | None,
    ) -> PerPosition | None:
        """The old policy's, the reference's and the teacher's log-probs into `v`, with R3's
        `replay`; returns the routing the training steps replay (R3's, or R2's recorded in the
        old pass)."""
        cfg, batch = self.cfg.loss, part.batch
        entropy = cfg.use_rollout_entropy
        if cfg.use_rollout_logprobs:  # the engine's log-probs are the old policy
            assert batch.rollout_log_probs is not None  # validate() checked
            v.old = {p: torch.tensor(batch.rollout_log_probs[p], dtype=torch.float32) for p in mine}
        else:
            record = self.cfg.moe.use_routing_replay
            old_weights = (
                self.kept.generating(batch, mine) if cfg.keep_old_actor else contextlib.nullcontext()
            )
            with old_weights, clock("log_probs"):
                old = self.backend.log_prob_pass(batch, plans, Pass(replay, entropy, record))
            v.old = old.log_probs
            if old.entropy is not None:
                v.entropies["entropy"] = old.entropy
            if record:  # R2: the passes below replay this routing
                replay = old.routing
        if cfg.needs_ref:
            with self.backend.reference_weights(), clock("ref_log_probs"):
                ref = self.backend.log_prob_pass(batch, plans, Pass(replay, entropy))
            v.ref = ref.log_probs
            if ref.entropy is not None:
                v.entropies["ref_entropy"] = ref.entropy
        opd = self.cfg.opd
        if opd.in_train:  # routed by the teacher's own routers (slime's fallthrough: no replay)
            with self._teacher_weights():
                v.teacher = self.backend.log_prob_pass(batch, plans, Pass()).log_probs
        elif opd.enabled:
            assert batch.teacher_log_probs is not None  # train() checked
            v.teacher = {p: torch.tensor(batch.teacher_log_probs[p], dtype=torch.float32) for p in mine}
        return replay

    # ---- training ---------------------------------------------------------------------------
    def train(
        self,
        rollout_id: int,
        data: RolloutBatch | RolloutPart,
        values: dict[int, list[float]] | None = None,
        update: bool = True,
    ) -> TrainOutput:
        """One rollout's optimizer steps. `values`: PPO's critic values of every response token,
        keyed by sample index (the output then carries the returns of this rank's samples, the
        critic's targets). Without `update` (--num-critic-only-steps) no step is taken: the
        advantages and returns are computed, the weights stay."""
        part = RolloutPart.of(data)
        batch = part.batch
        self.check_vocabulary(batch, need_rollout_log_probs=self.cfg.loss.needs_rollout_log_probs)
        if (values is None) != (self.cfg.loss.advantage_estimator != "ppo"):
            raise BatchError(
                "--advantage-estimator ppo trains with the critic's values"
                if values is None
                else f"critic values given with --advantage-estimator {self.cfg.loss.advantage_estimator}"
            )
        plans = self.plan(part)
        mine = planning.positions(plans)
        if values is not None:  # every rank raises the first rank's error: none waits in a collective
            index = batch.sample_indices or part.positions
            wrong = measures.uncovered(batch, mine, index, values)
            problem = (
                None
                if wrong is None
                else (
                    f"sample {index[wrong]}: the critic's values do not cover its "
                    f"{batch.response_lengths[wrong]} response tokens "
                    f"({len(values[index[wrong]]) if index[wrong] in values else 'none'} given)"
                )
            )
            measures.raise_agreed(problem)
        if self.cfg.opd.on_samples and batch.teacher_log_probs is None:  # every part alike
            raise BatchError(
                "--use-opd --opd-type sglang: the rollout's samples carry no 'teacher_log_probs', or not "
                "all of them (the teacher engine scores them during the rollout; a custom rollout, reward "
                "or post-process function must set them; a replayed dump must have been made with OPD)"
            )
        with self.profiler.train_call(rollout_id):
            return self._train(rollout_id, part, plans, mine, TokenValues(critic=values), update)

    def _train(
        self,
        rollout_id: int,
        part: RolloutPart,
        plans: list[StepPlan],
        mine: list[int],
        v: TokenValues,
        update: bool,
    ) -> TrainOutput:
        loss_cfg, b = self.cfg.loss, self.backend
        batch = part.batch
        output = TrainOutput()
        clock = perf.PassClock(b.device)  # slime's perf/*: each pass's time, its device work included
        start = time.perf_counter()
        replay = self._replay(batch, mine)
        compute = loss_cfg.compute_advantages_and_returns
        if compute and (loss_cfg.loss_type == "policy_loss" or batch.rollout_log_probs is not None):
            with self.profiler.phase("train_log_probs"):
                replay = self._log_probs(part, self.log_prob_plans(part, plans), mine, v, clock, replay)
            output.rollout.update(measures.rollout_metrics(self.cfg, batch, mine, v, b.dp_group))
            if self.cfg.check_precision:
                output.precision.update(measures.precision_stats(batch, mine, v, b.dp_group))
        if compute and loss_cfg.loss_type == "policy_loss":
            if v.critic is not None:
                v.advantages, v.returns = self._ppo_advantages(part, mine, v)
                index = batch.sample_indices or part.positions
                output.returns = {index[p]: v.returns[p].tolist() for p in mine}
            else:
                v.advantages = self._advantages(part, mine, v)
        logprob_done = time.perf_counter()
        if self.cfg.save_debug_train_data and b.writes_train_data:
            measures.save_train_data(self.cfg, (b.dp_rank, b.dp_size), rollout_id, part, mine, v)
        if update and self.cfg.optimizer.reset_optimizer_states:
            reset_states(b.optimizer)
        with self.profiler.phase("train_actor"):
            for k, step in enumerate(plans if update else []):
                compare = v.old if k == 0 and self.cfg.check_precision else None
                loss = PolicyLoss(loss_cfg, self.loss_hooks, batch, step, v, compare)
                with clock("actor_train"):
                    output.steps.append(b.train_step(batch, step, loss, replay))
                if compare is not None:
                    output.precision["first_step_max_abs_diff"] = measures.max_over_ranks(loss.worst.value)
        output.timings.update(log_probs=logprob_done - start, train=time.perf_counter() - logprob_done)
        output.perf = self.step_perf.metrics(part.lengths, b.world_size, clock.seconds)
        every = loss_cfg.ref_update_interval  # the reference becomes the weights trained so far
        if every and update and b.ref_state is not None and (rollout_id + 1) % every == 0:
            b.ref_state = b.snapshot()
        return output

    # ---- advantages -------------------------------------------------------------------------
    def _opd(
        self, advantages: list[torch.Tensor], mine: list[int], v: TokenValues, masks: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """The OPD penalty on the estimator's advantages (before whitening, as slime): the student
        is the old policy (the engine's log-probs with --use-rollout-logprobs, as slime's)."""
        if v.teacher is None:
            return advantages
        assert v.old is not None
        student, teacher = [v.old[p] for p in mine], [v.teacher[p] for p in mine]
        return adv.opd_penalty(advantages, student, teacher, self.cfg.opd.kl_coef, masks)

    def _kl(self, mine: list[int], v: TokenValues) -> list[torch.Tensor] | None:
        if v.ref is None:
            return None
        assert v.old is not None
        return [approx_kl(v.old[p], v.ref[p], self.cfg.loss.kl_loss_type) for p in mine]

    def _whiten(self, values: list[torch.Tensor], masks: list[torch.Tensor]) -> list[torch.Tensor]:
        """Whitened over every replica's tokens."""
        stats = adv.whitening_stats(values, masks)
        dist.all_reduce(stats, group=self.backend.dp_group)
        return adv.whiten(values, masks, stats)

    def _ppo_advantages(
        self, part: RolloutPart, mine: list[int], v: TokenValues
    ) -> tuple[PerPosition, PerPosition]:
        """PPO: GAE over the critic's values (slime.algo.advantages.ppo_advantages), whitened
        with --normalize-advantages; and the returns (the critic's targets)."""
        cfg = self.cfg.loss
        batch = part.batch
        index = batch.sample_indices or part.positions
        assert v.critic is not None
        values = [torch.tensor(v.critic[index[p]], dtype=torch.float32) for p in mine]  # train() checked
        masks = [loss_mask(batch, p) for p in mine]
        rewards = torch.tensor([part.rewards[part.positions[p]] for p in mine], dtype=torch.float32)
        advantages, returns = adv.ppo_advantages(
            rewards, values, masks, self._kl(mine, v), cfg.kl_coef, cfg.gamma, cfg.lambd
        )
        advantages = self._opd(advantages, mine, v, masks)  # the returns stay the critic's targets
        if cfg.normalize_advantages:
            advantages = self._whiten(advantages, masks)
        return dict(zip(mine, advantages)), dict(zip(mine, returns))

    def _advantages(self, part: RolloutPart, mine: list[int], v: TokenValues) -> PerPosition:
        cfg = self.cfg.loss
        # Groups are normalised over the whole rollout: a group's samples may sit on other replicas.
        if part.rewards_normalized or not cfg.rewards_normalization:
            scalars = torch.tensor(part.rewards, dtype=torch.float32)  # post-processed, or raw by request
        else:
            scalars = adv.normalize_group_rewards(
                part.rewards,
                part.group_indices,
                cfg.advantage_estimator,
                not cfg.disable_grpo_std_normalization,
                part.executions,
            )
        masks = [loss_mask(part.batch, p) for p in mine]
        values = adv.compute_advantages(
            cfg.advantage_estimator,
            scalars[[part.positions[p] for p in mine]],
            masks,
            kl=self._kl(mine, v),
            kl_coef=cfg.kl_coef,
            gamma=cfg.gamma,
        )
        values = self._opd(values, mine, v, masks)
        if cfg.normalize_advantages or cfg.advantage_estimator.startswith("reinforce_plus_plus"):
            values = self._whiten(values, masks)
        return dict(zip(mine, values))
