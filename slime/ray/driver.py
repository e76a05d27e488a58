"""The job as train.py and train_async.py run it: Ray, the processes, the loop's parts and hooks,
then slime.loop.core.Loop; everything is shut down on the way out, failed or not."""

from __future__ import annotations

import logging
import os
from typing import Any

import ray

from slime.config.arguments import Config, describe
from slime.debug.phases import load_phase_hook
from slime.loop import hooks
from slime.loop.core import CONTINUOUS, ONE_STEP_OFF, SYNC, Hook, Loop, Schedule
from slime.loop.metrics import Metrics
from slime.ray.inputs import check_inputs
from slime.ray.job import Job
from slime.ray.placement import data_parallel_size, job_placement
from slime.ray.rollout_source import ContinuousRollouts, GeneratedRollouts, ReplayedRollouts
from slime.ray.waiting import RolloutBar
from slime.utils.job_trace import RECORDER

logger = logging.getLogger(__name__)


def num_rollouts(config: Config, num_prompts: int) -> int:
    if config.rollout.num_rollout is not None:
        return config.rollout.num_rollout
    assert config.rollout.num_epoch is not None
    return max(1, config.rollout.num_epoch * num_prompts // config.rollout.rollout_batch_size)


def start_ray(config: Config) -> None:
    """Attach to the cluster at RAY_ADDRESS (`auto`: the one `ray start` last started on this
    machine), or start a local one sized for the layout. Without RAY_ADDRESS the job starts its
    own Ray even where `ray start` ran (plain `ray.init()` would attach to that one, and fail on
    the CPU count only a new Ray may be given)."""
    address = os.environ.get("RAY_ADDRESS") or None
    init: dict[str, Any] = {"log_to_driver": True, "include_dashboard": False}
    if not address and config.cluster.device == "cpu":
        # A local CPU cluster: each "GPU" is one process, not one core, so the logical CPU
        # count must cover every bundle even on a 2-core machine.
        needed = job_placement(config).num_bundles
        init["num_cpus"] = max(os.cpu_count() or 1, needed)
    ray.init(address=address or "local", **init)


def make_hooks(
    config: Config,
    log_dir: str,
    train: bool,
    engines: bool,
    replay: ReplayedRollouts | None,
    evaluator: Any,
    tracker: Any,
    progress: RolloutBar,
    tracing: Hook | None = None,
) -> list[Hook]:
    """The hooks the flags ask for, in the order they run (metrics last: it logs the record the
    others filled). `train`/`engines`: whether the job has a train group / an engine group;
    `tracing`: --trace-dir's drain, just before the metrics (a step's time includes it)."""
    d = config.debug
    adapter = config.train.lora.pushes_adapter
    out: list[Hook] = []
    if d.sync_parameters_path:
        out.append(
            hooks.SyncParametersDump(os.path.abspath(d.sync_parameters_path), adapter)
        )  # the engines' dir
    if train and engines:
        if d.check_weight_update_equal:
            out.append(hooks.WeightUpdateEqualCheck(adapter))
        elif d.check_precision or config.cluster.external_engine_addrs or config.train.lora.pushes_adapter:
            why = (
                "--check-precision"
                if d.check_precision
                else "external engines"
                if config.cluster.external_engine_addrs
                else "--lora-push adapter (the engines serve the adapter once it is pushed)"
            )
            out.append(hooks.FirstPush(why))
    if d.check_precision and train:
        out.append(hooks.PrecisionGates(config, log_dir, replay.temperature if replay is not None else None))
    if train and (d.ci_test or d.ci_save_grad_norm or d.ci_load_grad_norm):
        from slime.loop.ci_checks import CIChecks

        out.append(CIChecks(d, config.train.moe.use_rollout_routing_replay))
    if config.eval.interval is not None and evaluator is not None:
        out.append(hooks.Evaluate(evaluator, config.eval.interval, config.eval.before_train, tracker.log))
    if train and (config.checkpoint.save or config.checkpoint.save_hf):
        c = config.checkpoint
        out.append(hooks.Save(c.save_interval, bool(c.save), bool(c.save_hf)))
    out += [tracing] if tracing is not None else []
    out.append(Metrics(tracker, progress, config.logging.wandb_always_use_train_step))
    return out


def rollout_schedule(
    config: Config, manager: Any, replay: ReplayedRollouts | None, progress: RolloutBar, off_policy: bool
) -> tuple[GeneratedRollouts | None, Schedule]:
    """Where generated rollouts come from (the rollout manager's rollouts, or its continuous pool
    with --fully-async; None without a manager), and the loop's schedule."""
    fully_async = config.rollout.asynchrony.fully_async
    generated = None
    if manager is not None:
        kind = ContinuousRollouts if fully_async and replay is None else GeneratedRollouts
        generated = kind(manager, progress)
    if fully_async and replay is None:
        return generated, CONTINUOUS
    if fully_async:
        logger.info("--fully-async: the saved rollouts are replayed in order; the schedule does not apply")
    return generated, ONE_STEP_OFF if off_policy else SYNC


def run(config: Config, off_policy: bool, log_dir: str) -> int:
    """Run the whole job; returns the process exit code."""
    from slime.utils.tracking import Tracker

    os.makedirs(log_dir, exist_ok=True)
    if off_policy and config.train.lora.pushes_adapter and config.cluster.rollout_backend == "sglang":
        from slime.config.lora import sglang_async_problem
        from slime.utils.errors import UsageError

        raise UsageError(sglang_async_problem("train_async.py"))
    check_inputs(config)
    replay = None
    if config.debug.load_rollout_data:  # every dump is checked before any process starts
        replay = ReplayedRollouts(config, None if config.debug.rollout_only else data_parallel_size(config))
    job = tracker = progress = tracing = None
    try:
        if config.debug.trace_dir is not None:  # checked writable above
            from slime.ray.tracing import JobTracing

            tracing = JobTracing(config.debug.trace_dir)
        started = RECORDER.now_ns()
        start_ray(config)
        job = Job(config, log_dir)
        if tracing is not None:
            tracing.attach(job)
        logger.info(job.banner())
        tracker = Tracker(log_dir, config.logging, describe(config))
        if job.manager is not None:
            total = num_rollouts(config, ray.get(job.manager.num_prompts.remote()))
        else:
            assert config.rollout.num_rollout is not None
            total = config.rollout.num_rollout
        resumed = job.infos[0]["resumed_rollout_id"] if job.infos else None
        progress = RolloutBar(total, 0 if resumed is None else resumed + 1, job.manager)
        phase = load_phase_hook(config.debug.phase_hook)
        train, engines = job.groups(progress, phase)
        generated, schedule = rollout_schedule(config, job.manager, replay, progress, off_policy)
        source = replay if replay is not None else generated
        assert source is not None
        loop_hooks = make_hooks(
            config,
            log_dir,
            train is not None,
            engines is not None,
            replay,
            generated,
            tracker,
            progress,
            tracing,
        )
        logger.info("schedule: %s", schedule.name)
        loop = Loop(
            source,
            train,
            engines,
            schedule,
            loop_hooks,
            total,
            phase,
            config.bridge.update_weights_interval,
            config.checkpoint.start_rollout_id,
        )
        if generated is not None and config.rollout.fault_tolerance:
            generated.idle = loop.heal
        RECORDER.complete("startup", started, RECORDER.now_ns(), "loop")  # Ray, the processes, the models
        loop.run()
        return 0
    finally:
        if progress is not None:
            progress.close()
        try:
            if tracing is not None:  # before the processes go: their last events
                tracing.finish()
        finally:  # a second Ctrl-C during it still shuts the job down
            if tracker is not None:
                tracker.close()
            if job is not None:
                job.close()
            ray.shutdown()
