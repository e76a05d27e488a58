"""Producing rollouts: the data source, the engines' HTTP side, rewards, the continuous pool,
packaging and evaluation, with no Ray in it (tested in process like slime.loop.core).

A `RolloutProducer` turns a rollout id into samples (the built-in rollout, the user's
--rollout-function-path, or the --fully-async continuous pool), scores them, and packages them:
one train part per data-parallel replica, handed to `put` (Ray's object store in a job), and a
typed summary for the driver (metrics, counts, weight versions, the data position, the dump
path). It writes the --save-debug-rollout-data and --save-debug-eval-data dumps, runs
evaluation, and carries the data position for checkpoints. The Ray actor around it is
slime.ray.rollout_manager.RolloutManager.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from slime.config.arguments import Config
from slime.config.eval_sets import EvalDataset, eval_flag
from slime.debug.phases import load_phase_hook
from slime.engines.client import ClientConfig, EngineClient
from slime.rollout.base_types import number_groups
from slime.rollout.builtin_rollout import GenerationProgress, RolloutGenerator
from slime.rollout.continuous import ContinuousPool
from slime.rollout.data import Prompt, PromptDataset
from slime.rollout.dump import make_meta, save_dump
from slime.rollout.engine_meter import EngineMeter
from slime.rollout.health import EngineHealth
from slime.rollout.rewards import RewardModel
from slime.rollout.rollout_function import rollout_function_samples
from slime.rollout.summary import (
    eval_metrics,
    flag_metrics,
    package_rollout,
    request_perf_metrics,
    reward_post_process,
    rollout_metrics,
)
from slime.rollout.teacher import TeacherScorer
from slime.rollout.vision import vision_processor
from slime.utils.async_utils import run
from slime.utils.misc import load_function
from slime.utils.rollout_batch import Evaluation, Rollout
from slime.utils.sample import Sample, group_samples

logger = logging.getLogger(__name__)


class RolloutProducer:
    """Produces rollouts and evaluations from the engines it is connected to, with no Ray in it:
    the rollout manager actor (slime.ray.rollout_manager) holds one, and tests drive one in
    process. Built without the engines (the tokenizer, the data and the user's functions load
    while the engines start), then `connect(engine_urls)` once they answer.

    `dp_size`: the data-parallel replicas each rollout is split for (None: nothing trains);
    `put(part)`: where each replica's part goes (Ray's object store in a job; kept as it is
    in process); `api_key`: the key the engines require."""

    def __init__(
        self,
        config: Config,
        dp_size: int | None = None,
        put: Callable[[Any], Any] = lambda part: part,
        api_key: str | None = None,
    ):
        from transformers import AutoTokenizer

        if config.train.deterministic:  # user reward and rollout functions that draw numbers
            import random

            random.seed(config.train.seed)
        self.config = config
        self.engine_urls: list[str] = []
        self.router_url: str | None = None
        """The router in front of the engines (slime.engines.router_front); None: groups go to
        the engines directly, each to the one it is placed on."""
        self.dp_size = dp_size
        self.put = put
        # Every engine call (a whole generation included) is bounded by --distributed-timeout-minutes.
        self.client_config = ClientConfig(
            timeout_s=config.train.distributed_timeout_minutes * 60,
            max_concurrency=config.args.sglang_server_concurrency,
            api_key=api_key,
        )
        r = config.rollout
        self.tokenizer = AutoTokenizer.from_pretrained(config.train.hf_checkpoint)
        if config.debug.dump_details:  # the tokenizer beside the dumps, as slime leaves it
            self.tokenizer.save_pretrained(os.path.join(config.debug.dump_details, "tokenizer"))
        self.processor = vision_processor(config)  # --multimodal-keys: the checkpoint's processor
        data = r.data if r.global_dataset else None
        self.dataset = (
            PromptDataset(data, self.tokenizer, processor=self.processor) if data is not None else None
        )
        self.reward = (
            RewardModel(r.rm_type, r.custom_rm_path, r.group_rm, config.args)
            if r.rm_type or r.custom_rm_path
            else None
        )
        # slime's rollout function: f(args, rollout_id, data_source, evaluation=False) -> groups.
        self.rollout_fn = (
            load_function(r.rollout_function_path, "--rollout-function-path")
            if r.rollout_function_path
            else None
        )
        self.generate_fn = (
            load_function(r.custom_generate_function_path, "--custom-generate-function-path")
            if r.custom_generate_function_path
            else None
        )
        self.post_process = reward_post_process(r.reward_post_process_path, config.args)
        self.filter = (
            load_function(r.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path")
            if r.dynamic_sampling_filter_path
            else None
        )
        path = getattr(config.args, "rollout_sample_filter_path", None)
        self.sample_filter = load_function(path, "--rollout-sample-filter-path") if path else None
        self.progress = GenerationProgress()
        self.pool: ContinuousPool | None = None
        """--fully-async: the groups in flight across rollouts (started by the first take)."""
        self.engine_meter = EngineMeter()
        self.carried: list[tuple[Prompt, list[Sample]]] = []
        """--partial-rollout (synchronous and one-step-off): the groups a rollout's over-sampling cut
        off, with their tokens, continued first by the next rollout."""
        self.phase = load_phase_hook(config.debug.phase_hook)
        self.health: EngineHealth | None = None
        self.teacher: TeacherScorer | None = None
        """--use-opd --opd-type sglang: the teacher engine that scores each training sample."""
        # Per evaluation set: (set, prompts, reward, generate function); its own ones replace the rollout's.
        self.eval_sets = [
            (
                ds,
                PromptDataset(ds.data, self.tokenizer, eval_flag(ds), self.processor),
                self._set_reward(ds),
                self._set_generate(ds),
            )
            for ds in config.eval.datasets
        ]

    def _set_reward(self, ds: EvalDataset) -> RewardModel | None:
        """An evaluation set's reward: its custom_rm_path, else its rm_type, else the rollout's."""
        if ds.custom_rm_path or ds.rm_type:
            return RewardModel(ds.rm_type, ds.custom_rm_path, False, self.config.args)
        return self.reward

    def _set_generate(self, ds: EvalDataset) -> Callable[..., Any] | None:
        path = ds.custom_generate_function_path
        if path is None:
            return self.generate_fn
        return load_function(path, f"{eval_flag(ds)} custom_generate_function_path")

    def connect(self, engine_urls: list[str], teacher_url: str | None = None) -> None:
        """Generate with the engines at `engine_urls` (once, before the first rollout); score
        with the OPD teacher at `teacher_url` (an engine the job started) or --opd-teacher-url.
        With --use-fault-tolerance their health is followed (`health`): engines found down have
        their groups generated elsewhere until they are replaced."""
        assert not self.engine_urls, "connect() runs once"
        config, r = self.config, self.config.rollout
        self.engine_urls = list(engine_urls)
        url = teacher_url or config.opd.teacher_url
        if config.opd.scores_in_rollout and url is not None:
            self.teacher = TeacherScorer(url, EngineClient(url, self.client_config), r.sampling.temperature)
            run(self.teacher.check(self.tokenizer, config.train.hf_checkpoint))
        if r.fault_tolerance and self.engine_urls:
            self.health = EngineHealth(self.engine_urls)

    def close(self) -> None:
        """Stop the continuous pool and close the teacher's client."""
        if self.pool is not None:
            pool, self.pool = self.pool, None
            run(pool.close())
        if self.teacher is not None:
            run(self.teacher.client.close())

    def num_prompts(self) -> int:
        return len(self.dataset) if self.dataset is not None else 0

    def generate(self, rollout_id: int, weight_version: int = 0) -> Rollout:
        """Generate and score rollout `rollout_id` (the trainer is at `weight_version`); its parts
        go to the object store, its dump to --save-debug-rollout-data; the summary comes back."""
        start = time.perf_counter()
        self.progress.reward_seconds = 0.0

        def built_in() -> tuple[list[Sample], dict[str, float]]:
            if self.dataset is None:
                raise RuntimeError("the built-in rollout needs --prompt-data")
            samples, metrics = run(
                _generate(
                    self,
                    self.dataset,
                    self.config.rollout.rollout_batch_size,
                    self.config.rollout.sampling,
                    self.filter,
                    self._seed_keys("rollout", rollout_id),
                    (rollout_id, False),
                    self.reward,
                    self.generate_fn,
                )
            )
            if self.sample_filter is not None:  # slime's --rollout-sample-filter-path: sets remove_sample
                self.sample_filter(self.config.args, group_samples(samples))
                metrics["rollout/removed_samples"] = float(sum(s.remove_sample for s in samples))
            return samples, metrics

        if self.rollout_fn is not None:
            samples, extra = rollout_function_samples(
                self.rollout_fn, self.config, rollout_id, self.dataset, self.reward, built_in, self.progress
            )
        else:
            samples, extra = built_in()
        return self._package(rollout_id, weight_version, samples, extra, start)

    def take(self, rollout_id: int, weight_version: int) -> Rollout:
        """--fully-async: rollout `rollout_id` from the continuous pool, for training at
        `weight_version` (the engines have it: the pool may admit the groups it allows)."""
        start = time.perf_counter()
        self.progress.reward_seconds = 0.0
        if self.pool is None:
            self.pool = run(_start_pool(self, weight_version))
        else:
            run(_call(self.pool.set_version, weight_version))
        n = self.config.rollout.sampling.n_samples_per_prompt
        self.progress.done, self.progress.total = 0, self.config.rollout.rollout_batch_size * n
        taken = run(self.pool.take(weight_version))
        engines = run(self.engine_meter.read(self.pool.gen.live_clients()))
        self.progress.done = self.progress.total
        samples = number_groups(taken.groups, n, "the continuous pool")
        extra = {**taken.metrics, **engines}
        return self._package(rollout_id, weight_version, samples, extra, start)

    def _package(
        self,
        rollout_id: int,
        weight_version: int,
        samples: list[Sample],
        extra: dict[str, float],
        start: float,
    ) -> Rollout:
        if self.teacher is not None:  # samples a rollout function made (the built-in's are scored)
            start_teacher = time.perf_counter()
            if run(self.teacher.score_all(samples)):
                extra["time/teacher"] = time.perf_counter() - start_teacher
        metrics = {**rollout_metrics(samples, self.config.rollout.reward_key), **extra}
        metrics.update(flag_metrics(self.config.rollout, samples, "rollout"))
        metrics.update(request_perf_metrics(samples))  # from the samples' traces
        metrics["time/generate"] = time.perf_counter() - start
        metrics["time/reward"] = self.progress.reward_seconds
        dump_path = None
        if self.config.debug.save_rollout_data:
            dump_path = save_dump(
                self.config.debug.save_rollout_data,
                rollout_id,
                [s.to_dict() for s in samples],
                {**self._meta(False), "weight_version": weight_version},
            )
        split = (self.config.train.batch, self.dp_size) if self.dp_size else None
        return package_rollout(
            rollout_id,
            samples,
            self.config.rollout.reward_key,
            split,
            self.put,
            metrics,
            self.post_process,
            self.config.opd.on_samples,
            data_state=self.state_dict(),
            dump_path=dump_path,
        )

    def evaluate(self, rollout_id: int) -> Evaluation:
        """Metrics of every evaluation set; their samples to --save-debug-eval-data when set."""
        assert self.eval_sets
        metrics: dict[str, float] = {}
        every: list[Sample] = []
        counts: list[list[Any]] = []  # [name, samples] per set, in the dump's order
        for ds, dataset, reward, generate_fn in self.eval_sets:
            dataset.epoch = dataset.offset = 0
            built_in = functools.partial(self._evaluate_set, rollout_id, ds, dataset, reward, generate_fn)
            if self.rollout_fn is not None:
                samples, extra = rollout_function_samples(
                    self.rollout_fn, self.config, rollout_id, dataset, reward, built_in, self.progress, ds
                )
                metrics.update(extra)
            else:
                samples, _ = built_in()
            metrics.update(eval_metrics(ds, samples, self.config.rollout))
            every += samples
            counts.append([ds.name, len(samples)])
        dump_path = None
        if self.config.debug.save_eval_data:
            dump_path = save_dump(
                self.config.debug.save_eval_data,
                rollout_id,
                [s.to_dict() for s in every],
                {**self._meta(True), "weight_version": -1, "eval_sets": counts},
            )
        return Evaluation(metrics, dump_path)

    def _evaluate_set(
        self,
        rollout_id: int,
        ds: EvalDataset,
        dataset: PromptDataset,
        reward: RewardModel | None,
        generate_fn: Callable[..., Any] | None,
    ) -> tuple[list[Sample], dict[str, float]]:
        """One evaluation set through the built-in rollout (every prompt, no filter)."""
        key = ("eval", rollout_id) if ds.name is None else ("eval", ds.name, rollout_id)
        samples, _ = run(
            _generate(
                self,
                dataset,
                len(dataset),
                ds.sampling,
                None,
                self._seed_keys(*key),
                (rollout_id, True),
                reward,
                generate_fn,
            )
        )
        return samples, {}

    def _meta(self, evaluation: bool) -> dict[str, Any]:
        """What a dump records for its replay (tokenizer and model fingerprints, rollout flags)."""
        return make_meta(self.config.args, self.tokenizer, evaluation=evaluation)

    def _seed_keys(self, *key: int | str) -> tuple[int | str, ...] | None:
        """--deterministic-mode: what every sample's sampling_seed is derived from."""
        return (self.config.train.seed, *key) if self.config.train.deterministic else None

    def replace_engine(self, index: int, url: str) -> None:
        """A restarted engine, given the current weights, takes the place (and the turn) of the
        one that went down."""
        self.engine_urls[index] = url
        if self.health is not None:
            self.health.replace(index, url)

    def state_dict(self) -> dict[str, Any]:
        """The data position; with --fully-async the prompts drawn and not yet trained on are
        in it, drawn first by a resumed run."""
        if self.dataset is None:
            return {}
        if self.pool is not None:
            return self.dataset.state_dict(self.pool.pending_prompts())
        return self.dataset.state_dict([p for p, _ in self.carried] or None)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.dataset is not None and state:
            self.dataset.load_state_dict(state)


# The producer's coroutines run on the process's one background loop (slime.utils.async_utils, as in
# slime): what a plugin keeps between rollouts (a GenerateState semaphore, an aiohttp session) stays
# bound to a loop that is still running. They are module functions, called through `run` from the
# producer's synchronous methods, which the rollout manager actor calls from Ray's threads.
async def _start_pool(producer: RolloutProducer, version: int) -> ContinuousPool:
    """The continuous pool of `producer`, started on the background loop."""
    if producer.dataset is None:
        raise RuntimeError("--fully-async needs --prompt-data")
    r = producer.config.rollout
    clients = [EngineClient(u, producer.client_config) for u in producer.engine_urls]
    gen = RolloutGenerator(
        producer.dataset,
        clients,
        producer.reward,
        r.sampling,
        r.rollout_batch_size,
        None,
        None,
        producer.config.args,
        producer.generate_fn,
        GenerationProgress(),
        producer._seed_keys("continuous"),
        producer.health,
        None,
        route_to_engine=producer.router_url is None,
    )
    gen.mask_offpolicy, gen.teacher = r.asynchrony.mask_offpolicy, producer.teacher
    concurrency = producer.config.args.sglang_server_concurrency * max(1, len(clients))
    cap = -(-concurrency // r.sampling.n_samples_per_prompt)
    pool = ContinuousPool(
        gen,
        producer.dataset,
        r.asynchrony,
        r.rollout_batch_size,
        cap,
        version,
        producer.filter,
        exact_versions=producer.config.cluster.rollout_backend == "torch",
    )
    await producer.engine_meter.read(clients)
    pool.top_up()
    logger.info("continuous rollout: up to %d groups in flight, lag bound %s", pool.cap, r.asynchrony.max_lag)
    return pool


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on the background loop (the pool's state is touched from that thread only)."""
    return fn(*args)


async def _generate(
    producer: RolloutProducer,
    dataset: PromptDataset,
    num_prompts: int,
    sampling: Any,
    group_filter: Any,
    seed_keys: tuple[int | str, ...] | None,
    which: tuple[int, bool],
    reward: RewardModel | None,
    generate_fn: Callable[..., Any] | None,
) -> tuple[list[Sample], dict[str, float]]:
    """The samples, and the dynamic filter's metrics. `which`: (rollout id, evaluation), for
    --debug-phase-hook."""
    groups = 0

    def on_group(engine: str) -> None:
        nonlocal groups
        groups += 1
        live = producer.health.live() if producer.health is not None else list(producer.engine_urls)
        router = producer.router_url
        producer.phase(
            "group_generated",
            rollout_id=which[0],
            evaluation=which[1],
            groups=groups,
            engine=engine,
            engines=live,
            router=router,
        )

    clients = [EngineClient(u, producer.client_config) for u in producer.engine_urls]  # health's slots too
    try:
        gen = RolloutGenerator(
            dataset,
            clients,
            reward,
            sampling,
            num_prompts,
            producer.config.rollout.over_sampling_batch_size,
            group_filter,
            producer.config.args,
            generate_fn,
            producer.progress,
            seed_keys,
            producer.health,
            on_group,
            route_to_engine=producer.router_url is None,
        )
        asynchrony = producer.config.rollout.asynchrony
        if asynchrony.partial and not which[1]:
            gen.carry, gen.mask_offpolicy = producer.carried, asynchrony.mask_offpolicy
        if not which[1]:  # evaluation samples are not trained on: no teacher
            gen.teacher = producer.teacher
        result = await gen.generate_rollout()
        metrics = result.filter_metrics()
        if not which[1] and producer.config.cluster.rollout_backend == "torch":
            live = set(producer.health.live()) if producer.health is not None else None
            # Over the whole step (generation and not); the clients of restarted engines are closed by now.
            metrics.update(
                await producer.engine_meter.read([c for c in clients if live is None or c.base_url in live])
            )
        for _, group in producer.carried:  # slime's mark: the rollout a partial sample started in
            for s in group:
                if s.response_length:
                    s.metadata.setdefault("start_rollout_id", which[0])
        return result.samples, metrics
    finally:
        await asyncio.gather(*(c.close() for c in clients))
