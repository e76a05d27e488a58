"""What every train backend does the same way, over its data-parallel ranks.

A backend's rank belongs to one data-parallel replica (`dp_rank` of `dp_size`); the ranks of a
replica (Megatron's tensor- and pipeline-parallel peers) see the same samples and hold the same
log-probs, advantages and metrics. This base class plans the optimizer steps and micro-batches,
runs the log-prob passes (the actor's, the reference's, the OPD teacher's) and computes the
advantages; its records are in slime.backends.train_records. A backend supplies the forward passes
(`_log_prob_pass`, `_train_step`), the reference-weight swap and its reductions' group (`dp_group`).
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
from slime.algo.losses import approx_kl, token_weights
from slime.algo.objective import MicroBatchTerms, micro_batch_loss
from slime.algo.plugins import LossHooks, Ragged
from slime.backends import old_actor, perf
from slime.backends.micro_batch import MicroBatch
from slime.backends.optim import move_state, reset_states
from slime.backends.routing import RouterHooks
from slime.backends.train_records import TrainRecords
from slime.config.train import TrainConfig
from slime.utils import batching
from slime.utils.batch import BatchError, RolloutBatch, RolloutPart, TrainOutput
from slime.utils.batching import StepPlan
from slime.utils.device_memory import release_device_memory
from slime.utils.errors import UsageError
from slime.utils.model_families import packable


class TrainActorBase(TrainRecords):
    """The backend-independent half of slime.backends.interface.TrainActor."""

    cfg: TrainConfig
    hf_config: Any
    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    dp_group: Any = None
    """Process group over which one sample's values are counted once (None: the default group)."""
    context_parallel: int = 1  # ranks a sequence is split over (Megatron's CP): a GPU's token budget x this
    rollout_id: int
    model: Any
    optimizer: torch.optim.Optimizer
    schedule: Any  # the learning-rate schedule (slime.backends.optim.LRSchedule)
    resumed_extra: dict[str, Any]
    """What the checkpoint resumed from carried besides the weights (the data position)."""
    device: torch.device

    # ---- backend hooks ----------------------------------------------------------------------
    def _log_prob_pass(self, batch: RolloutBatch, plans: list[StepPlan]) -> dict[int, torch.Tensor]:
        """Log-probs of the samples in `plans` (keyed by batch position), on every rank of the replica."""
        raise NotImplementedError

    def _train_step(
        self,
        batch: RolloutBatch,
        step: StepPlan,
        old: dict[int, torch.Tensor] | None,
        ref: dict[int, torch.Tensor] | None,
        advantages: dict[int, torch.Tensor] | None,
        compare: dict[int, torch.Tensor] | None = None,
        precision: dict[str, float] | None = None,
    ) -> dict[str, float]:
        """One optimizer step; its metrics summed over the global batch. With `compare` (the
        log-prob pass's values, --check-precision), the largest |log-prob pass - this forward|
        over the loss mask goes to precision["first_step_max_abs_diff"]."""
        raise NotImplementedError

    ref_state: dict[str, torch.Tensor] | None = None
    """This rank's part of the reference weights (None: the loss uses no reference)."""
    teacher_state: dict[str, torch.Tensor] | None = None
    """This rank's part of the OPD teacher's weights (--opd-type megatron; None otherwise)."""

    routing_tables: dict[int, torch.Tensor] | None = None
    """Routing replay during one `train` or `compute_log_probs` call: per batch position, the experts
    each token is routed to, [tokens, layers, top-k] (-1: the router's own); R3's or R2's."""
    recorded_routing: dict[int, torch.Tensor] | None = None  # R2: the next log-prob pass fills it
    pass_entropy: dict[int, torch.Tensor] | None = None  # --use-rollout-entropy: the next pass fills it
    kept: dict[str, dict[str, torch.Tensor]]  # --keep-old-actor: pushed versions' weights (old_actor.py)

    routing: RouterHooks | None = None
    """The router hooks of a mixture-of-experts model (None: a dense model)."""

    def _rollout_routing(self, batch: RolloutBatch, positions: list[int]) -> dict[int, torch.Tensor]:
        """R3: the engine's routing of the samples at `positions` as routing tables (checked)."""
        if self.routing is None:  # the actors refuse the flag with a dense model at start-up
            raise UsageError("--use-rollout-routing-replay needs a mixture-of-experts model")
        return self.routing.rollout_tables(batch, positions)

    def _snapshot(self) -> dict[str, torch.Tensor]:
        """A CPU copy of this rank's part of the weights."""
        raise NotImplementedError

    def _copy_in(self, state: dict[str, torch.Tensor]) -> None:
        """Write a `_snapshot`-shaped state into this rank's weights."""
        raise NotImplementedError

    @property
    def packs_sequences(self) -> bool:
        """Whether micro-batches are packed (one row, no padding; token budgets count real
        tokens): both backends pack unless --padded-micro-batches asks for the padded layout or
        the backend cannot keep the model's packed samples apart (slime.utils.model_families)."""
        model_type = getattr(getattr(self, "hf_config", None), "model_type", None)  # None: planning only
        return not self.cfg.batch.padded_micro_batches and packable(model_type, self.cfg.backend)

    @functools.cached_property
    def step_perf(self) -> perf.StepPerf:
        """The perf/* metrics' FLOPs count and peak (--peak-tflops), made at the first train call."""
        return perf.StepPerf(self.hf_config, self.device, self.cfg.peak_tflops, self.rank)

    @functools.cached_property
    def loss_hooks(self) -> LossHooks | None:
        """slime's loss hooks (--custom-tis-function-path, --custom-pg-loss-reducer-function-path)."""
        loss = self.cfg.loss
        return LossHooks.load(
            loss.custom_tis_function_path, loss.custom_pg_loss_reducer_function_path, self.cfg.plugin_args
        )

    def _reference_weights(self) -> contextlib.AbstractContextManager[None]:
        """Context: the reference weights are in the model, the actor's are restored after."""
        if self.ref_state is None:
            raise RuntimeError(
                "no reference model: the loss flags do not use one (--use-kl-loss / --kl-coef)"
            )
        return self._weights_of(self.ref_state)

    @contextlib.contextmanager
    def _weights_of(self, state: dict[str, torch.Tensor]) -> Iterator[None]:
        """Context: `state` (a `_snapshot`-shaped set of weights) is in the model, the actor's
        are restored after."""
        saved = self._snapshot()
        self._copy_in(state)
        try:
            yield
        finally:
            self._copy_in(saved)

    @contextlib.contextmanager
    def _teacher_weights(self) -> Iterator[None]:
        """Context: the OPD teacher's weights are in the model (--opd-type megatron), routed by
        its own routers (slime's fallthrough: no replay of the student's routing)."""
        assert self.teacher_state is not None
        tables, self.routing_tables = self.routing_tables, None
        try:
            with self._weights_of(self.teacher_state):
                yield
        finally:
            self.routing_tables = tables

    def _micro_batch_loss(
        self,
        batch: RolloutBatch,
        step: StepPlan,
        mb: MicroBatch,
        log_probs: torch.Tensor,
        entropy: torch.Tensor,
        values: tuple[dict[int, torch.Tensor] | None, ...],
        sums: dict[str, torch.Tensor],
        compare: dict[int, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, float]:
        """One micro-batch's share of the step's loss, from this forward's `log_probs` and
        `entropy` and the rollout's `values` = (old, ref, advantages); adds its metrics to `sums`.
        Also returns the largest |compare - log_probs| over the loss mask (0 without `compare`)."""
        cfg = self.cfg.loss
        dev = log_probs.device
        mask = mb.loss_mask.to(dev)
        gap = 0.0
        if compare is not None:
            before = mb.response_tensor([compare[p] for p in mb.positions]).to(dev)
            diffs = (before - log_probs.detach()).abs()[mask.bool()]
            gap = float(diffs.double().max()) if diffs.numel() else 0.0

        def lay_out(per_sample: Any) -> torch.Tensor | None:
            return (
                None
                if per_sample is None
                else mb.response_tensor([per_sample[p] for p in mb.positions]).to(dev)
            )

        old, ref, advantages = values
        weights = token_weights(
            mb.loss_mask,
            cfg.calculate_per_token_loss,
            step.num_executions,
            step.num_tokens,
            step.row_denominators(mb.positions),
        ).to(dev)
        terms = MicroBatchTerms(
            log_probs=log_probs,
            mask=mask,
            weights=weights,
            old_log_probs=lay_out(old),
            advantages=lay_out(advantages),
            ref_log_probs=lay_out(ref),
            rollout_log_probs=lay_out(batch.rollout_log_probs),
            entropy=entropy if cfg.entropy_coef != 0 else entropy.detach(),
            ragged=Ragged(
                list(mb.response_lengths), [p + r for p, r in zip(mb.prompt_lengths, mb.response_lengths)]
            ),
            normaliser=float(step.num_tokens if cfg.calculate_per_token_loss else step.num_executions),
        )
        loss, metrics = micro_batch_loss(cfg, terms, self.loss_hooks)
        for name, value in metrics.items():
            sums[name] += value.double().cpu()
        return loss, gap

    # ---- colocation -------------------------------------------------------------------------
    def sleep(self, keep_params: bool = False) -> None:
        """Move optimizer states, and parameters unless `keep_params`, to host memory (no-op on
        --device cpu). The loop keeps the parameters through the weight push (exporting them
        all-gathers on the device) and releases them after it."""
        self._move("cpu", params=not keep_params)

    def wake(self) -> None:
        self._move(self.device)

    def _move(self, device: str | torch.device, params: bool = True) -> None:
        if self.device.type == "cpu":
            return
        if params:
            self.model.to(device)
        move_state(self.optimizer, device)
        if torch.device(device).type == "cpu":
            release_device_memory()  # a colocated engine needs every byte, cuBLAS's workspaces too
        else:
            torch.cuda.synchronize()

    # ---- planning ---------------------------------------------------------------------------
    def plan(self, data: RolloutBatch | RolloutPart, max_tokens: int | None = None) -> list[StepPlan]:
        """This rank's micro-batches per optimizer step, as positions in the part's batch. Every
        rank packs every rank's share of the whole rollout, so micro-batch counts agree without
        talking."""
        part = RolloutPart.of(data)
        b = self.cfg.batch
        lengths = part.lengths
        global_batch = b.global_batch_for(part.num_executions)
        b.check_layout(self.dp_size, global_batch)
        if part.dp_size is not None and part.dp_size != self.dp_size:
            raise BatchError(
                f"the rollout was split for {part.dp_size} data-parallel replicas, but this job trains on "
                f"{self.dp_size}; the rollout manager and the train ranks disagree on the layout"
            )
        local, plans = {g: k for k, g in enumerate(part.positions)}, []
        flops = batching.flops_coefficient(self.hf_config) if b.balance_by_flops else None
        for step, shares in zip(
            batching.split_steps(part.num_samples, global_batch, part.executions),
            batching.step_shares(lengths, global_batch, self.dp_size, part.executions),
        ):
            if b.use_dynamic_batch_size:
                budget = max_tokens or b.max_tokens_per_gpu
                assert budget is not None
                budget *= self.context_parallel  # slime's rule: each GPU holds 1 / CP of a micro-batch
                per_rank = [
                    batching.pack_micro_batches(s, lengths, budget, self.packs_sequences)
                    if flops is None
                    else batching.flops_micro_batches(s, lengths, budget, flops)
                    for s in shares
                ]
            else:
                per_rank = [batching.fixed_micro_batches(s, b.micro_batch_size) for s in shares]
            per_rank, merged = batching.rank_micro_batches(per_rank, shares, lengths)
            if merged and self.dp_rank == 0 and not max_tokens:
                batching.warn_merged(len(step), self.dp_size, b.use_dynamic_batch_size)
            mine = per_rank[self.dp_rank]
            missing = [g for mb in mine for g in mb if g not in local]
            if missing:
                raise BatchError(
                    f"data-parallel rank {self.dp_rank} was given a part without sample(s) {missing[:5]} of "
                    "its share: the rollout was split by another rule or for another layout"
                )
            num_tokens = sum(part.loss_tokens[g] for g in step)
            norms = batching.execution_normalisers(step, part.loss_tokens, part.executions, local)
            plans.append(
                StepPlan([[local[g] for g in mb] for mb in mine], len(step), int(num_tokens), *norms)
            )
        return plans

    def _log_prob_plans(
        self, data: RolloutBatch | RolloutPart, train_plans: list[StepPlan]
    ) -> list[StepPlan]:
        # The same micro-batches as training (same padding, same kernels) make the first step's
        # ppo_kl exactly 0; a separate log-prob budget trades that for memory.
        budget = self.cfg.batch.log_probs_max_tokens_per_gpu
        if (
            budget is None
            or not self.cfg.batch.use_dynamic_batch_size
            or budget == self.cfg.batch.max_tokens_per_gpu
        ):
            return train_plans
        return self.plan(data, max_tokens=budget)

    def compute_log_probs(
        self, data: RolloutBatch | RolloutPart, use_reference: bool = False
    ) -> dict[int, list[float]]:
        part = RolloutPart.of(data)
        batch = part.batch
        batch.validate(self.hf_config.get_text_config().vocab_size)
        plans = self._log_prob_plans(part, self.plan(part))
        mine = [p for step in plans for mb in step.micro_batches for p in mb]
        with self._routing_replay(batch, mine):
            if use_reference:
                with self._reference_weights():
                    values = self._log_prob_pass(batch, plans)
            else:
                values = self._log_prob_pass(batch, plans)
        index = batch.sample_indices or part.positions
        return {index[p]: v.tolist() for p, v in values.items()}

    @contextlib.contextmanager
    def _routing_replay(self, batch: RolloutBatch, mine: list[int]) -> Iterator[None]:
        """Context of one call: R3's tables from the batch, or R2's recording armed."""
        moe = self.cfg.moe
        self.routing_tables = self._rollout_routing(batch, mine) if moe.use_rollout_routing_replay else None
        self.recorded_routing = {} if moe.use_routing_replay else None
        try:
            yield
        finally:
            self.routing_tables = self.recorded_routing = None

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
        batch.validate(
            self.hf_config.get_text_config().vocab_size,
            need_rollout_log_probs=self.cfg.loss.needs_rollout_log_probs,
        )
        if (values is None) != (self.cfg.loss.advantage_estimator != "ppo"):
            raise BatchError(
                "--advantage-estimator ppo trains with the critic's values"
                if values is None
                else f"critic values given with --advantage-estimator {self.cfg.loss.advantage_estimator}"
            )
        plans = self.plan(part)
        mine = [p for step in plans for mb in step.micro_batches for p in mb]
        if values is not None:  # every rank raises the first rank's error: none waits in a collective
            index = batch.sample_indices or part.positions
            wrong = self._uncovered(batch, mine, index, values)
            problem = (
                None
                if wrong is None
                else (
                    f"sample {index[wrong]}: the critic's values do not cover its "
                    f"{batch.response_lengths[wrong]} response tokens "
                    f"({len(values[index[wrong]]) if index[wrong] in values else 'none'} given)"
                )
            )
            self._raise_agreed(problem)
        opd = self.cfg.opd
        if opd.on_samples and batch.teacher_log_probs is None:  # every part alike
            raise BatchError(
                "--use-opd --opd-type sglang: the rollout's samples carry no 'teacher_log_probs', or not "
                "all of them (the teacher engine scores them during the rollout; a custom rollout, reward "
                "or post-process function must set them; a replayed dump must have been made with OPD)"
            )
        with self._routing_replay(batch, mine):
            return self._train(rollout_id, part, plans, mine, values, update)

    def _train(
        self,
        rollout_id: int,
        part: RolloutPart,
        plans: list[StepPlan],
        mine: list[int],
        critic_values: dict[int, list[float]] | None = None,
        update: bool = True,
    ) -> TrainOutput:
        loss_cfg = self.cfg.loss
        batch = part.batch
        output = TrainOutput()
        old = ref = teacher = None
        clock = perf.PassClock(self.device)  # slime's perf/*: each pass's time, its device work included
        start = time.perf_counter()
        compute = loss_cfg.compute_advantages_and_returns
        if compute and (loss_cfg.loss_type == "policy_loss" or batch.rollout_log_probs is not None):
            lp_plans = self._log_prob_plans(part, plans)
            # --use-rollout-entropy: each log-prob pass fills its own
            names = ("entropy", "ref_entropy") if loss_cfg.needs_ref else ("entropy",)
            entropies: dict[str, dict[int, torch.Tensor]] = {
                n: {} for n in names if loss_cfg.use_rollout_entropy
            }
            if loss_cfg.use_rollout_logprobs:  # the engine's log-probs are the old policy
                assert batch.rollout_log_probs is not None  # validate() checked
                old = {p: torch.tensor(batch.rollout_log_probs[p], dtype=torch.float32) for p in mine}
            else:
                self.pass_entropy = entropies.get("entropy")
                with old_actor.generating_weights(self, batch, mine), clock("log_probs"):  # --keep-old-actor
                    old = self._log_prob_pass(batch, lp_plans)
                if self.recorded_routing is not None:  # R2: the passes below replay this routing
                    self.routing_tables, self.recorded_routing = self.recorded_routing, None
            if loss_cfg.needs_ref:
                self.pass_entropy = entropies.get("ref_entropy")
                with self._reference_weights(), clock("ref_log_probs"):
                    ref = self._log_prob_pass(batch, lp_plans)
            self.pass_entropy = None
            teacher = self._teacher_log_probs(batch, mine, lp_plans)
            output.rollout.update(self._rollout_metrics(batch, mine, old, ref, teacher, entropies))
            if self.cfg.check_precision:
                output.precision.update(self._precision_stats(batch, mine, old, ref))
        advantages = returns = None
        if compute and loss_cfg.loss_type == "policy_loss":
            if critic_values is not None:
                advantages, returns = self._ppo_advantages(part, mine, old, ref, critic_values, teacher)
                index = batch.sample_indices or part.positions
                output.returns = {index[p]: returns[p].tolist() for p in mine}
            else:
                advantages = self._advantages(part, mine, old, ref, teacher)
        logprob_done = time.perf_counter()
        if self.cfg.save_debug_train_data:
            self._save_train_data(
                rollout_id, part, mine, old, ref, advantages, critic_values, returns, teacher
            )
        if update and self.cfg.optimizer.reset_optimizer_states:
            reset_states(self.optimizer)
        for k, step in enumerate(plans if update else []):
            compare = old if k == 0 and self.cfg.check_precision else None
            with clock("actor_train"):
                result = self._train_step(batch, step, old, ref, advantages, compare, output.precision)
            output.steps.append(result)
        output.timings.update(log_probs=logprob_done - start, train=time.perf_counter() - logprob_done)
        output.perf = self.step_perf.metrics(part.lengths, self.world_size, clock.seconds)
        every = self.cfg.loss.ref_update_interval  # the reference becomes the weights trained so far
        if every and update and self.ref_state is not None and (rollout_id + 1) % every == 0:
            self.ref_state = self._snapshot()
        self.rollout_id = rollout_id
        return output

    def _teacher_log_probs(
        self, batch: RolloutBatch, mine: list[int], plans: list[StepPlan]
    ) -> dict[int, torch.Tensor] | None:
        """OPD's teacher log-probs of this rank's samples: from the train pass with the teacher's
        weights (--opd-type megatron), or as the rollout's teacher engine gave them (None: no OPD)."""
        opd = self.cfg.opd
        if not opd.enabled:
            return None
        if opd.in_train:
            with self._teacher_weights():
                return self._log_prob_pass(batch, plans)
        assert batch.teacher_log_probs is not None  # train() checked
        return {p: torch.tensor(batch.teacher_log_probs[p], dtype=torch.float32) for p in mine}

    def _opd(
        self,
        advantages: list[torch.Tensor],
        mine: list[int],
        old: Any,
        teacher: Any,
        masks: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """The OPD penalty on the estimator's advantages (before whitening, as slime): the student
        is the old policy (the engine's log-probs with --use-rollout-logprobs, as slime's)."""
        if teacher is None:
            return advantages
        student = [old[p] for p in mine]
        return adv.opd_penalty(advantages, student, [teacher[p] for p in mine], self.cfg.opd.kl_coef, masks)

    def _ppo_advantages(
        self,
        part: RolloutPart,
        mine: list[int],
        old: Any,
        ref: Any,
        critic_values: dict[int, list[float]],
        teacher: Any = None,
    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """PPO: GAE over the critic's values (slime.algo.advantages.ppo_advantages), whitened
        with --normalize-advantages; and the returns (the critic's targets)."""
        cfg = self.cfg.loss
        batch = part.batch
        index = batch.sample_indices or part.positions
        values = [torch.tensor(critic_values[index[p]], dtype=torch.float32) for p in mine]  # train() checked
        masks = [self._loss_mask(batch, p) for p in mine]
        kl = [approx_kl(old[p], ref[p], cfg.kl_loss_type) for p in mine] if ref is not None else None
        rewards = torch.tensor([part.rewards[part.positions[p]] for p in mine], dtype=torch.float32)
        advantages, returns = adv.ppo_advantages(
            rewards, values, masks, kl, cfg.kl_coef, cfg.gamma, cfg.lambd
        )
        advantages = self._opd(advantages, mine, old, teacher, masks)  # the returns stay the critic's targets
        if cfg.normalize_advantages:
            stats = adv.whitening_stats(advantages, masks)
            dist.all_reduce(stats, group=self.dp_group)
            advantages = adv.whiten(advantages, masks, stats)
        return dict(zip(mine, advantages)), dict(zip(mine, returns))

    def _advantages(
        self, part: RolloutPart, mine: list[int], old: Any, ref: Any, teacher: Any = None
    ) -> dict[int, torch.Tensor]:
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
        masks = [self._loss_mask(part.batch, p) for p in mine]
        kl = [approx_kl(old[p], ref[p], cfg.kl_loss_type) for p in mine] if ref is not None else None
        values = adv.compute_advantages(
            cfg.advantage_estimator,
            scalars[[part.positions[p] for p in mine]],
            masks,
            kl=kl,
            kl_coef=cfg.kl_coef,
            gamma=cfg.gamma,
        )
        values = self._opd(values, mine, old, teacher, masks)
        if cfg.normalize_advantages or cfg.advantage_estimator.startswith("reinforce_plus_plus"):
            stats = adv.whitening_stats(values, masks)
            dist.all_reduce(stats, group=self.dp_group)
            values = adv.whiten(values, masks, stats)
        return dict(zip(mine, values))
