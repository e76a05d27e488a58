"""The RL loop: placement → engines → rollout manager → train ranks → (generate, train, push)*.

One loop for both schedules. `off_policy=False` (train.py): generate k, train k, push. With
`off_policy=True` (train_async.py) the generation of rollout k+1 is started before training k,
so its samples come from weights one version older; that staleness is checked, never more.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from typing import Any

import ray

from slime.backends.interface import RolloutBatch
from slime.config.arguments import Config, describe
from slime.ray.checks import check_precision, check_weight_update_equal, sync_parameters_dump
from slime.ray.job import Job, wait_refs
from slime.ray.placement import plan_placement
from slime.rollout.dump import DumpError, check_fingerprint, load_dump, make_meta, save_dump, subsample
from slime.rollout.sample import Sample, samples_to_batch

logger = logging.getLogger(__name__)


def num_rollouts(config: Config, num_prompts: int) -> int:
    if config.rollout.num_rollout is not None:
        return config.rollout.num_rollout
    assert config.rollout.num_epoch is not None
    return max(1, config.rollout.num_epoch * num_prompts // config.rollout.rollout_batch_size)


def check_staleness(batch_versions: list[str | None], current: int, off_policy: bool) -> None:
    allowed = 1 if off_policy else 0
    for v in batch_versions:
        if v is None or current - int(v) > allowed:
            raise RuntimeError(
                f"a sample was generated with weight_version {v} while the trainer is at {current}: "
                f"more than {allowed} version(s) stale"
            )


class StepClock:
    """Wall time per phase of one step, and the idle/orchestration remainder."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.phases: dict[str, float] = {}

    def add(self, phase: str, seconds: float) -> None:
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds

    def timed(self, phase: str) -> _Phase:
        return _Phase(self, phase)

    def breakdown(self, generate_on_path: float, inside: dict[str, float]) -> dict[str, float]:
        """time/* of the step: `generate_on_path` is the generation time the step waited for
        (all of it when synchronous, what training did not hide when off-policy); `inside`
        holds the components' own measurements (log-probs and train on rank 0, reward)."""
        step = time.perf_counter() - self.start
        work = generate_on_path + sum(self.phases.values()) + inside["time/log_probs"] + inside["time/train"]
        out = {f"time/{k}": v for k, v in self.phases.items()}
        out.update(inside)
        out["time/step"] = step
        out["time/idle"] = max(0.0, step - work)
        out["time/idle_ratio"] = out["time/idle"] / step if step > 0 else 0.0
        return out


class _Phase:
    def __init__(self, clock: StepClock, phase: str):
        self.clock, self.phase = clock, phase

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.clock.add(self.phase, time.perf_counter() - self.t0)


class Progress:
    """A tqdm bar over the rollouts whose postfix names the running phase (and, while
    generating, the samples done). Off when stderr is not a terminal: logs get one line per step."""

    def __init__(self, total: int, initial: int, manager: Any):
        from tqdm import tqdm

        self.manager = manager
        self.bar = tqdm(total=total, initial=initial, desc="rollouts", unit="step", disable=None, leave=True)

    def wait(self, refs: Any, phase: str, timeout_s: float | None = None) -> Any:
        """wait_refs(refs), showing `phase` on the bar meanwhile (and, while generating, the
        samples done)."""
        if self.bar.disable:
            return wait_refs(refs, timeout_s)
        self.bar.set_postfix_str(phase)

        def poll() -> None:
            if phase == "generate" and self.manager is not None:
                done, total = ray.get(self.manager.progress_counts.remote())
                self.bar.set_postfix_str(f"generate {done}/{total} samples")

        return wait_refs(refs, timeout_s, poll)

    def step(self, summary: str) -> None:
        self.bar.update(1)
        self.bar.set_postfix_str(summary)

    def close(self) -> None:
        self.bar.close()


class Replay:
    """--load-debug-rollout-data: the saved rollouts, read and checked in the driver."""

    def __init__(self, config: Config):
        d = config.debug
        assert d.load_rollout_data is not None and config.rollout.num_rollout is not None
        self.config = config
        self.tokenizer = _tokenizer(config.train.hf_checkpoint)
        missing = [
            d.load_rollout_data.format(rollout_id=i)
            for i in range(config.rollout.num_rollout)
            if not os.path.isfile(d.load_rollout_data.format(rollout_id=i))
        ]
        if missing:
            raise DumpError(
                f"--load-debug-rollout-data: {len(missing)} of the {config.rollout.num_rollout} rollout dumps "
                f"(--num-rollout) do not exist, first {missing[0]!r}; lower --num-rollout or save them first"
            )
        first = self.load(0)  # format and tokenizer fingerprint, before any process starts
        # The temperature the dump's log-probs were computed at (greedy rollouts report T = 1).
        self.temperature = float(first[4].get("rollout_temperature") or 1.0)

    def load(
        self, rollout_id: int
    ) -> tuple[RolloutBatch, dict[str, float], list[dict[str, Any]], None, dict]:
        """(batch, rollout metrics, samples, no data position, the flags the dump was made with)."""
        from slime.ray.rollout_manager import rollout_metrics

        d = self.config.debug
        assert d.load_rollout_data is not None
        path = d.load_rollout_data.format(rollout_id=rollout_id)
        dump = load_dump(path)
        check_fingerprint(dump, path, self.tokenizer, d.allow_tokenizer_mismatch)
        kept = subsample(dump["samples"], d.subsample)
        renumber = {g: k for k, g in enumerate(dict.fromkeys(s["group_index"] for s in kept))}
        samples = [Sample.from_dict({**s, "group_index": renumber[s["group_index"]]}) for s in kept]
        metrics = rollout_metrics(samples, self.config.rollout.reward_key)
        metrics["time/generate"] = 0.0
        flags = dump["meta"].get("flags", {})
        return samples_to_batch(samples, self.config.rollout.reward_key), metrics, kept, None, flags


def produce(job: Job, replay: Replay | None, rollout_id: int) -> Any:
    """A rollout: a Ray reference to the manager's generation, or a replayed dump."""
    if replay is not None:
        return replay.load(rollout_id)
    return job.manager.generate.remote(rollout_id)


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def dump_meta(config: Config, weight_version: int, evaluation: bool = False) -> dict[str, Any]:
    meta = make_meta(config.args, _tokenizer(config.train.hf_checkpoint), evaluation=evaluation)
    return {**meta, "weight_version": weight_version}


def evaluate(config: Config, job: Job, rollout_id: int, progress: Progress | None) -> dict[str, float]:
    """Evaluate on --eval-prompt-data; with --save-debug-eval-data the samples go to that template."""
    ref = job.manager.evaluate.remote(rollout_id, config.debug.save_eval_data is not None)
    metrics, samples = progress.wait(ref, "eval") if progress is not None else ray.get(ref)
    if config.debug.save_eval_data:
        path = save_dump(
            config.debug.save_eval_data, rollout_id, samples, dump_meta(config, -1, evaluation=True)
        )
        logger.info("eval after rollout %d saved to %s", rollout_id, path)
    return metrics


def rollout_only_step(
    config: Config, job: Job, tracker: Any, progress: Progress, clock: StepClock,
    rollout_id: int, total: int, rollout_metrics: dict[str, float],
) -> None:  # fmt: skip
    """--debug-rollout-only: log the rollout's metrics (reward, accuracy, lengths) and evaluate."""
    record: dict[str, Any] = {"rollout_id": rollout_id, **rollout_metrics}
    if config.eval.interval and (rollout_id + 1) % config.eval.interval == 0:
        with clock.timed("eval"):
            record.update(evaluate(config, job, rollout_id, progress))
    record["time/step"] = time.perf_counter() - clock.start
    tracker.log(record, step=rollout_id + 1)
    summary = _short(record)
    progress.step(summary)
    logger.info("rollout %d/%d (rollout only) %s", rollout_id + 1, total, summary)


def run(config: Config, off_policy: bool, log_dir: str) -> int:
    """Run the whole job; returns the process exit code."""
    from slime.utils.tracking import Tracker

    os.makedirs(log_dir, exist_ok=True)
    replay = Replay(config) if config.debug.load_rollout_data else None  # checks every dump first
    address = os.environ.get("RAY_ADDRESS")
    init: dict[str, Any] = {"log_to_driver": True, "include_dashboard": False}
    if not address and config.cluster.device == "cpu":
        # A local CPU cluster: each "GPU" is one process, not one core, so the logical CPU
        # count must cover every bundle even on a 2-core machine.
        needed = plan_placement(
            config.cluster, not config.debug.rollout_only, not config.debug.train_only
        ).num_bundles
        init["num_cpus"] = max(os.cpu_count() or 1, needed)
    ray.init(address=address, **init)
    job = tracker = progress = None
    try:
        job = Job(config, log_dir)
        logger.info(job.banner())
        tracker = Tracker(log_dir, config.logging, describe(config))
        if job.manager is not None:
            total = num_rollouts(config, ray.get(job.manager.num_prompts.remote()))
        else:
            assert config.rollout.num_rollout is not None
            total = config.rollout.num_rollout
        resumed = job.infos[0]["resumed_rollout_id"] if job.infos else None
        start = 0 if resumed is None else resumed + 1
        version = start
        if resumed is not None:
            data_state = job.infos[0]["resumed_extra"].get("data")
            if data_state is not None and job.manager is not None:
                ray.get(job.manager.load_state_dict.remote(data_state))
            job.push(version)  # the engines start from --hf-checkpoint: give them the resumed weights
            logger.info("resumed after rollout %d (data position %s)", resumed, data_state)
        if config.debug.sync_parameters_path:
            sync_parameters_dump(job, config.debug.sync_parameters_path, version)
            return 0
        external = bool(config.cluster.external_engine_addrs)
        if config.debug.check_weight_update_equal and job.train and job.engine_urls:
            check_weight_update_equal(job, version, resumed is not None)
        elif resumed is None and (config.debug.check_precision or external) and job.train and job.engine_urls:
            # Launched engines loaded --hf-checkpoint themselves; pushing the trainer's copy over it
            # makes the first rollout's trainer-vs-engine gate check the bridge as well. External
            # engines may hold anything: they always get the trainer's weights first.
            stats = job.push(version)
            why = "--check-precision" if config.debug.check_precision else "external engines"
            logger.info("%s: pushed the trainer's weights before the first rollout (%d bytes)",
                        why, int(stats.get("bytes", 0)))  # fmt: skip
        evaluating = config.eval.interval is not None
        if evaluating and start == 0 and config.eval.before_train:
            t0 = time.perf_counter()
            before = evaluate(config, job, -1, progress=None)
            before["time/eval"] = time.perf_counter() - t0
            tracker.log({"rollout_id": -1, **before}, step=0)
            logger.info("eval before training: %s", _short(before))
        progress = Progress(total, start, job.manager)
        pending: Any = None
        saved, data_state = None, None
        for rollout_id in range(start, total):
            clock = StepClock()
            if pending is None:  # synchronous, or the first off-policy step
                pending = produce(job, replay, rollout_id)
            t0 = time.perf_counter()
            batch, rollout_metrics, samples, data_state, *_ = progress.wait(pending, "generate")
            waited = time.perf_counter() - t0
            if config.debug.save_rollout_data:
                with clock.timed("save_debug_data"):
                    path = save_dump(
                        config.debug.save_rollout_data, rollout_id, samples, dump_meta(config, version)
                    )
                logger.info("rollout %d saved to %s", rollout_id, path)
            if not job.train:  # --debug-rollout-only: no trainer, the weights stay --hf-checkpoint's
                pending = None
                rollout_only_step(config, job, tracker, progress, clock, rollout_id, total, rollout_metrics)
                continue
            if replay is None:
                check_staleness([s["weight_version"] for s in samples], version, off_policy)
            pending = produce(job, replay, rollout_id + 1) if off_policy and rollout_id + 1 < total else None
            with clock.timed("colocate"):
                job.before_train(generation_running=pending is not None)
            train_call = time.perf_counter()
            outputs = job.wait_train([t.train.remote(rollout_id, batch) for t in job.train],
                                     f"the train step of rollout {rollout_id}", progress, "train")  # fmt: skip
            train_call = time.perf_counter() - train_call
            if config.debug.check_precision:
                check_precision(config, replay, log_dir, rollout_id, rollout_id == start, resumed is not None,
                                outputs[0])  # fmt: skip
            if pending is not None and replay is None:
                t0 = time.perf_counter()
                progress.wait(pending, "generate")  # the engines must be idle before the push
                waited += time.perf_counter() - t0
            version += 1
            with clock.timed("push"):
                job.restart_down_engines()
                job.before_push()
                push_stats = job.push(version, progress)
            inside = {f"time/{k}": v for k, v in outputs[0].timings.items()}
            record: dict[str, Any] = {
                "rollout_id": rollout_id,
                **{k: v for k, v in rollout_metrics.items() if k != "time/generate"},
                # The trainer's token means: log_probs, ref_log_probs, rollout_log_probs, kl, and
                # train_rollout_logprob_abs_diff (trainer vs engine).
                **{f"rollout/{k}": v for k, v in outputs[0].rollout.items()},
                "push/bytes": push_stats.get("bytes", 0.0),
            }
            for k, v in (outputs[0].steps[-1] if outputs[0].steps else {}).items():
                record[f"train/{k}"] = v
            if evaluating and (rollout_id + 1) % config.eval.interval == 0:  # type: ignore[operator]
                with clock.timed("eval"):
                    record.update(evaluate(config, job, rollout_id, progress))
            if (
                config.checkpoint.save
                and config.checkpoint.save_interval
                and (rollout_id + 1) % config.checkpoint.save_interval == 0
            ):
                with clock.timed("save"):
                    ray.get(
                        [
                            t.save.remote(rollout_id, config.checkpoint.save, {"data": data_state})
                            for t in job.train
                        ]
                    )
                saved = rollout_id
            # Synchronously the step waited for all of the generation; off-policy only for what
            # training did not hide. The train call's Ray overhead beyond the actor's own
            # log-prob and train time counts as idle.
            generate_on_path = rollout_metrics["time/generate"] if not off_policy else waited
            inside["time/train_call_overhead"] = max(
                0.0, train_call - inside.get("time/log_probs", 0.0) - inside.get("time/train", 0.0)
            )
            inside.setdefault("time/log_probs", 0.0)
            inside.setdefault("time/train", 0.0)
            record.update(clock.breakdown(generate_on_path, inside))
            record["time/generate"] = rollout_metrics["time/generate"]
            record["time/wait_generate"] = waited
            tracker.log(record, step=rollout_id + 1)
            summary = _short(record)
            progress.step(summary)
            logger.info("rollout %d/%d %s", rollout_id + 1, total, summary)
        if config.checkpoint.save and job.train and start < total and saved != total - 1:
            ray.get(
                [t.save.remote(total - 1, config.checkpoint.save, {"data": data_state}) for t in job.train]
            )
        if config.checkpoint.save_hf:
            ray.get([t.save_hf.remote(config.checkpoint.save_hf) for t in job.train])
        return 0
    finally:
        if progress is not None:
            progress.close()
        if tracker is not None:
            tracker.close()
        if job is not None:
            job.close()
        ray.shutdown()


def _short(record: dict[str, Any]) -> str:
    keys = (
        "rollout/reward_mean",
        "rollout/accuracy",
        "eval/accuracy",
        "train/loss",
        "train/grad_norm",
        "time/step",
        "time/generate",
        "time/train",
        "time/push",
    )

    def label(key: str) -> str:
        return (
            key.replace("/", "_")
            if key.startswith("eval/") or key == "rollout/accuracy"
            else key.split("/")[-1]
        )

    return " ".join(f"{label(k)}={record[k]:.4g}" for k in keys if k in record)
