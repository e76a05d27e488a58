"""The RolloutManager actor: data source, engines' HTTP side, rewards, rollout metrics.

It owns no model. It turns a rollout id into a `RolloutBatch` for the trainer plus the
rollout-side metrics, runs evaluation, releases/resumes engine memory for colocation, and
carries the data position for checkpoints.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import statistics
import time
from typing import Any

from slime.backends.interface import RolloutBatch
from slime.config.arguments import Config
from slime.config.rollout import DataConfig
from slime.engines.client import ClientConfig, EngineClient
from slime.rollout.data import PromptDataset
from slime.rollout.health import EngineHealth, HealthMonitor
from slime.rollout.manager import DataSource, Progress, RolloutGenerator, number_groups
from slime.rollout.rewards import RewardModel, load_function
from slime.rollout.sample import Sample, Status, samples_to_batch
from slime.utils.aio import run_sync

logger = logging.getLogger(__name__)


def rollout_metrics(
    samples: list[Sample], reward_key: str | None, prefix: str = "rollout"
) -> dict[str, float]:
    rewards = [s.scalar_reward(reward_key) for s in samples]
    lengths = [s.response_length for s in samples]
    lps = [lp for s in samples for lp in (s.rollout_log_probs or [])]
    out = {
        f"{prefix}/reward_mean": statistics.fmean(rewards),
        f"{prefix}/response_length_mean": statistics.fmean(lengths),
        f"{prefix}/truncated_ratio": sum(s.status == Status.TRUNCATED for s in samples) / len(samples),
        f"{prefix}/num_samples": float(len(samples)),
    }
    if all(r in (0.0, 1.0) for r in rewards):
        out[f"{prefix}/accuracy"] = statistics.fmean(rewards)
    if lps and prefix != "rollout":  # a rollout's are reported by the trainer, over its loss mask
        out[f"{prefix}/rollout_log_probs"] = statistics.fmean(lps)
    return out


class RolloutManager:
    """Produces rollouts and evaluations from the engines at `engine_urls` (a Ray actor)."""

    def __init__(self, config: Config, engine_urls: list[str], log_dir: str = "."):
        from transformers import AutoTokenizer

        from slime.utils.logging_utils import configure_logging

        configure_logging("rollout")
        if config.train.deterministic:  # user reward and rollout functions that draw numbers
            import random

            random.seed(config.train.seed)
        self.config = config
        self.engine_urls = engine_urls
        # Every engine call (a whole generation included) is bounded by --distributed-timeout-minutes.
        self.client_config = ClientConfig(timeout_s=config.train.distributed_timeout_minutes * 60)
        r = config.rollout
        self.tokenizer = AutoTokenizer.from_pretrained(config.train.hf_checkpoint)
        self.dataset = PromptDataset(r.data, self.tokenizer) if r.data is not None else None
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
        # slime's custom functions post to http://{args.sglang_router_ip}:{args.sglang_router_port}:
        # the router in front of every engine, or (torch engines without a router) engine 0.
        self.registered: list[str] = []  # engines slime added to the router
        self.router = self._router(config, engine_urls, log_dir)
        if self.router is not None:
            config.args.sglang_router_ip, config.args.sglang_router_port = self.router.host, self.router.port
        elif engine_urls:
            host, _, port = engine_urls[0].removeprefix("http://").rpartition(":")
            config.args.sglang_router_ip, config.args.sglang_router_port = host, int(port)
        self.filter = (
            load_function(r.dynamic_sampling_filter_path, "--dynamic-sampling-filter-path")
            if r.dynamic_sampling_filter_path
            else None
        )
        self.progress = Progress()
        # --rollout-health-check-interval: engines found down (by the monitor or a failed request)
        # have their groups generated elsewhere and are restarted by the loop before a push.
        self.health: EngineHealth | None = None
        self.monitor: HealthMonitor | None = None
        if r.health_check_interval is not None and engine_urls:
            self.health = EngineHealth()
            self.monitor = HealthMonitor(
                self.engine_urls, self.health, r.health_check_interval, r.health_check_timeout
            )
        self.eval_dataset = None
        if config.eval.prompt_data:
            eval_cfg = DataConfig(
                **{**(r.data or DataConfig(config.eval.prompt_data)).__dict__,
                   "prompt_data": config.eval.prompt_data, "shuffle": False}
            )  # fmt: skip
            self.eval_dataset = PromptDataset(eval_cfg, self.tokenizer, "--eval-prompt-data")

    def _router(self, config: Config, engine_urls: list[str], log_dir: str) -> Any:
        """The sglang-router (slime.engines.router): started for --rollout-backend sglang, or the
        one named by --sglang-router-ip/port; every engine is registered with it."""
        from slime.engines.router import Router

        c = config.cluster
        if not engine_urls or (c.rollout_backend != "sglang" and c.router_ip is None):
            return None
        if c.router_ip is not None:
            assert c.router_port is not None
            router = Router(c.router_ip, c.router_port)
        else:
            from slime.ray.actors import engine_host

            router = Router.start(engine_host(), os.path.join(log_dir, "router.log"))
        try:
            listed = router.workers()
        except OSError as e:
            raise RuntimeError(
                f"--sglang-router-ip/--sglang-router-port: no sglang-router answers at {router.url} ({e}); "
                "start it first or fix the address"
            ) from None
        for url in engine_urls:
            if url not in listed:
                router.add_worker(url)
                self.registered.append(url)
        logger.info("router %s in front of engines %s", router.url, ", ".join(engine_urls))
        return router

    def close(self) -> None:
        """Stop the router slime started (a router given by --sglang-router-ip keeps running;
        the engines slime registered there are removed from it)."""
        if self.router is None:
            return
        if self.router.proc is not None:
            self.router.stop()
            return
        for url in self.registered:
            try:
                self.router.remove_worker(url)
            except Exception as e:  # shutting down: the router may be gone
                logger.warning("removing %s from the router: %s", url, e)

    def num_prompts(self) -> int:
        return len(self.dataset) if self.dataset is not None else 0

    def generate(
        self, rollout_id: int
    ) -> tuple[RolloutBatch, dict[str, float], list[dict[str, Any]], dict[str, int]]:
        """The rollout's train batch, metrics, samples (plain dicts) and the data position after it."""
        start = time.perf_counter()
        self.progress.reward_seconds = 0.0
        if self.rollout_fn is not None:
            samples = run_sync(self._rollout_fn_samples(rollout_id, self.dataset, evaluation=False))
        else:
            assert self.dataset is not None
            samples = run_sync(
                self._generate(
                    self.dataset,
                    self.config.rollout.rollout_batch_size,
                    self.config.rollout.sampling,
                    self.filter,
                    self._seed_keys("rollout", rollout_id),
                )
            )
        metrics = rollout_metrics(samples, self.config.rollout.reward_key)
        metrics["time/generate"] = time.perf_counter() - start
        metrics["time/reward"] = self.progress.reward_seconds
        batch = samples_to_batch(samples, self.config.rollout.reward_key)
        return batch, metrics, [s.to_dict() for s in samples], self.state_dict()

    def evaluate(
        self, rollout_id: int, return_samples: bool = False
    ) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """Metrics on the eval data, and its samples (plain dicts) when asked."""
        assert self.eval_dataset is not None and self.config.eval.sampling is not None
        sampling = self.config.eval.sampling
        self.eval_dataset.epoch = self.eval_dataset.offset = 0
        if self.rollout_fn is not None:
            samples = run_sync(self._rollout_fn_samples(rollout_id, self.eval_dataset, evaluation=True))
        else:
            samples = run_sync(
                self._generate(
                    self.eval_dataset,
                    len(self.eval_dataset),
                    sampling,
                    None,
                    self._seed_keys("eval", rollout_id),
                )
            )
        metrics = rollout_metrics(samples, self.config.rollout.reward_key, prefix="eval")
        return metrics, [s.to_dict() for s in samples] if return_samples else []

    def progress_counts(self) -> tuple[int, int]:
        """(samples finished, samples wanted) of the generation running now (a concurrent call)."""
        return self.progress.done, self.progress.total

    async def _rollout_fn_samples(
        self, rollout_id: int, dataset: PromptDataset | None, evaluation: bool
    ) -> list[Sample]:
        """Run the user's rollout function; score the samples it left without a reward."""
        assert self.rollout_fn is not None
        flag = "--rollout-function-path"
        n = (
            self.config.eval.n_samples_per_prompt
            if evaluation
            else self.config.rollout.sampling.n_samples_per_prompt
        )
        result = self.rollout_fn(self.config.args, rollout_id, DataSource(dataset, n), evaluation=evaluation)
        if inspect.isawaitable(result):
            result = await result
        samples = number_groups(result, n, flag)
        groups: dict[int, list[Sample]] = {}
        for s in samples:
            groups.setdefault(s.group_index, []).append(s)
        unscored = [g for g in groups.values() if any(s.reward is None for s in g)]
        if unscored and self.reward is None:
            raise ValueError(
                f"{flag} returned samples without a reward and no --rm-type/--custom-rm-path is set to score them"
            )
        start = time.perf_counter()
        for group in unscored:
            assert self.reward is not None
            # A group reward scores the whole group; others only the samples left unscored.
            await self.reward.score_group(
                group if self.reward.group else [s for s in group if s.reward is None]
            )
        self.progress.reward_seconds += time.perf_counter() - start
        return samples

    def _seed_keys(self, kind: str, rollout_id: int) -> tuple[int | str, ...] | None:
        """--deterministic-mode: what every sample's sampling_seed is derived from."""
        return (self.config.train.seed, kind, rollout_id) if self.config.train.deterministic else None

    async def _generate(
        self,
        dataset: PromptDataset,
        num_prompts: int,
        sampling: Any,
        group_filter: Any,
        seed_keys: tuple[int | str, ...] | None = None,
    ) -> list[Sample]:
        clients = [EngineClient(u, self.client_config) for u in self.engine_urls]
        try:
            assert self.reward is not None
            gen = RolloutGenerator(
                dataset, clients, self.reward, sampling, num_prompts,
                self.config.rollout.over_sampling_batch_size, group_filter, self.config.args, self.generate_fn,
                self.progress, seed_keys, self.health,
            )  # fmt: skip
            return (await gen.generate_rollout()).samples
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    def engines(self, method: str, *args: Any) -> list[Any]:
        """Call a client method (release/resume memory, weights_checker, ...) on every engine;
        their answers in engine order."""

        async def call() -> list[Any]:
            clients = [EngineClient(u, self.client_config) for u in self.engine_urls]
            try:
                return list(await asyncio.gather(*(getattr(c, method)(*args) for c in clients)))
            finally:
                await asyncio.gather(*(c.close() for c in clients))

        return run_sync(call())

    def down_engines(self) -> dict[int, str]:
        """Engine index -> why it is down (empty without --rollout-health-check-interval)."""
        if self.health is None:
            return {}
        down = self.health.down()
        return {j: down[u] for j, u in enumerate(self.engine_urls) if u in down}

    def replace_engine(self, index: int, url: str) -> None:
        """A restarted engine takes the place (and the turn) of the one that went down."""
        old = self.engine_urls[index]
        self.engine_urls[index] = url  # the monitor's list is this one
        if self.router is not None:
            self.router.remove_worker(old)
            self.router.add_worker(url)
            self.registered = [u for u in self.registered if u != old] + [url]
        if self.health is not None:
            self.health.clear(old)

    def dump_parameters(self, root: str) -> list[int]:
        """--debug-sync-parameters-path: every engine's parameters to root/<engine rank>/ (the
        torch engine has tensor-parallel size 1, so engine j is rank j)."""

        async def call() -> list[int]:
            clients = [EngineClient(u, self.client_config) for u in self.engine_urls]
            try:
                answers = await asyncio.gather(
                    *(c.dump_parameters(os.path.join(root, str(j))) for j, c in enumerate(clients))
                )
                return [a["num_parameters"] for a in answers]
            finally:
                await asyncio.gather(*(c.close() for c in clients))

        return run_sync(call())

    def state_dict(self) -> dict[str, int]:
        return self.dataset.state_dict() if self.dataset is not None else {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if self.dataset is not None and state:
            self.dataset.load_state_dict(state)
