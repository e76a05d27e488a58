"""One rollout: prompts → n samples each through the engines → rewards → kept groups.

Groups are generated concurrently (the engine client bounds the number of requests in
flight). With `over_sampling_batch_size` more prompts are started than needed; with a dynamic
sampling filter, groups the filter rejects are dropped and more prompts are drawn until
`rollout_batch_size` groups are kept. Once enough groups are kept, the requests still running
are aborted and their groups discarded. Every sample keeps the weight version it was generated
with.

Each sample is traced as slime's default rollout traces it (slime.observability.trace_utils): a
`generate_and_rm_group` span over its group, its `generate_and_rm` around the generate function
and its `sglang_generate` engine calls. The group is scored at once when its samples are done, so
its `reward_model` (or `group_reward_model`) span follows the samples' `generate_and_rm` inside
the group's span, where slime's, per sample, ends each `generate_and_rm`.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slime.config.rollout import SamplingConfig
from slime.engines.client import EngineClient, EngineError
from slime.observability.trace_utils import trace_span
from slime.rollout.base_types import number_groups
from slime.rollout.data import Prompt, PromptDataset
from slime.rollout.default_generate import continue_sample, generate
from slime.rollout.filter_hub.base_types import as_filter_output, drops
from slime.rollout.health import EngineHealth, engine_down
from slime.rollout.rewards import RewardModel, score_unscored
from slime.utils.net import host_port
from slime.utils.processing_utils import prompt_images
from slime.utils.sample import Sample, Status

logger = logging.getLogger(__name__)


@dataclass
class GenerationProgress:
    """Samples of kept-or-pending groups finished so far, for a progress bar (read from another thread)."""

    done: int = 0
    total: int = 0
    reward_seconds: float = 0.0  # summed over groups; part of the generation's wall time


@dataclass
class RolloutResult:
    samples: list[Sample]
    num_prompts_started: int
    num_groups_filtered: int
    num_groups_aborted: int
    num_groups_surplus: (
        int  # finished after enough groups were kept (discarded, or carried: --partial-rollout)
    )
    drop_reasons: dict[str, int] = field(default_factory=dict)
    """Groups the dynamic-sampling filter dropped, by the reason it gave."""
    num_groups_continued: int | None = None
    """--partial-rollout: groups the previous rollout cut off, continued in this one (None: off)."""
    num_groups_carried: int | None = None
    """--partial-rollout: groups this rollout cut off, kept with their tokens for the next one."""

    def filter_metrics(self) -> dict[str, float]:
        """slime's names: rollout/dynamic_filter/drop_<reason>; with --partial-rollout, the groups
        continued from the previous rollout and carried into the next."""
        m = {f"rollout/dynamic_filter/drop_{r}": float(n) for r, n in sorted(self.drop_reasons.items())}
        if self.num_groups_continued is not None and self.num_groups_carried is not None:
            m["rollout/partial_groups_continued"] = float(self.num_groups_continued)
            m["rollout/partial_groups_carried"] = float(self.num_groups_carried)
        return m


class RolloutGenerator:
    """Produces one rollout's samples from a dataset, engines and a reward model."""

    def __init__(
        self,
        dataset: PromptDataset,
        clients: list[EngineClient],
        reward: RewardModel | None,
        sampling: SamplingConfig,
        rollout_batch_size: int,
        over_sampling_batch_size: int | None = None,
        group_filter: Callable[[Any, list[Sample]], Any] | None = None,
        args: Any = None,
        generate_fn: Callable[..., Any] | None = None,
        progress: GenerationProgress | None = None,
        seed_keys: tuple[int | str, ...] | None = None,
        health: EngineHealth | None = None,
        on_group: Callable[[str], None] | None = None,
        route_to_engine: bool = False,
    ):
        """`seed_keys` (--deterministic-mode): every sample gets a `sampling_seed` derived from
        them, its prompt's draw order and its index in the group, and finished groups are taken
        in draw order, so the rollout does not depend on which group finished first."""
        if not clients:
            raise ValueError("the rollout needs at least one engine")
        self.dataset = dataset
        self.clients = clients
        self.reward = reward
        self.sampling = sampling
        self.rollout_batch_size = rollout_batch_size
        self.over_sampling_batch_size = over_sampling_batch_size or rollout_batch_size
        self.group_filter = group_filter
        self.args = args
        self.generate_fn = generate_fn
        self._next_client = itertools.cycle(range(len(clients)))
        self.progress = progress or GenerationProgress()
        self.progress.done = 0
        self.progress.reward_seconds = 0.0
        self.progress.total = rollout_batch_size * sampling.n_samples_per_prompt
        self.seed_keys = seed_keys
        self.health = health
        self.on_group = on_group  # called with the engine's address when a group is generated
        self.route_to_engine = route_to_engine  # no router: custom functions post to the group's engine
        self._turn = -1
        self._by_url = {c.base_url: c for c in clients}
        self._opened: list[EngineClient] = []  # clients of restarted engines, closed at the end
        self.mask_offpolicy = False
        """--mask-offpolicy-in-partial-rollout: a continued sample's earlier tokens leave the loss."""
        self.teacher: Any = None
        """--use-opd --opd-type sglang: a slime.rollout.teacher.TeacherScorer; each finished group
        is scored with it after its reward."""
        self.carry: list[tuple[Prompt, list[Sample]]] | None = None
        """--partial-rollout outside the continuous schedule: the groups over-sampling cut off, with
        what they generated. generate_rollout continues these first and leaves the groups it
        cuts off in it (the rollout manager keeps the list from one rollout to the next)."""

    async def _pick(self) -> EngineClient:
        """The next engine in turn that is up. With engine health tracking and every engine
        down, wait (up to the client's timeout) for one to be restarted and given the weights."""
        if self.health is None:
            return self.clients[next(self._next_client)]
        deadline = None
        while True:
            live = self.health.live()
            if live:
                self._turn += 1
                return self._client(live[self._turn % len(live)])
            loop = asyncio.get_running_loop()
            if deadline is None:
                deadline = loop.time() + self.clients[0].config.timeout_s
                logger.warning(
                    "every engine is down (%s); waiting up to %.0f s for a restart",
                    self.health.down(),
                    self.clients[0].config.timeout_s,
                )
            elif loop.time() > deadline:
                raise RuntimeError(
                    f"every engine has been down for {self.clients[0].config.timeout_s:.0f} s "
                    f"({self.health.down()}); the rollout cannot go on"
                )
            await asyncio.sleep(0.2)

    def _client(self, url: str) -> EngineClient:
        """The client of the engine at `url` (a restarted engine gets one the first time)."""
        client = self._by_url.get(url)
        if client is None:
            client = self._by_url[url] = EngineClient(url, self.clients[0].config)
            self._opened.append(client)
        return client

    async def group(self, prompt: Prompt, draw: int, partial: list[Sample] | None = None) -> list[Sample]:
        """One prompt's samples; `partial`: the group's samples so far, its aborted ones continued
        (--partial-rollout). With engine health tracking, a group whose engine goes down (its
        request failed, or the engine was marked down meanwhile) is generated again on a live
        engine: from scratch, or from `partial` (a failed continuation leaves a sample as it was)."""
        # A group that fails on engine after engine is the request's fault, not the engines':
        # after a few engines, its last error ends the rollout (rather than restarting them all).
        attempts = 2 * len(self.clients) + 1
        for attempt in range(1, attempts + 1):
            client = await self._pick()
            try:
                group = await self._attempt(client, prompt, draw, partial)
            except EngineError as e:
                if self.health is None or not engine_down(e) or attempt == attempts:
                    raise
                self.health.mark_down(client.base_url, e.message)
                group = None
            if group is not None:
                if self.on_group is not None:
                    self.on_group(client.base_url)
                return group
            logger.warning(
                "prompt %d: engine %s went down; its group is generated again", prompt.index, client.base_url
            )
        raise AssertionError("unreachable")

    async def _attempt(
        self, client: EngineClient, prompt: Prompt, draw: int, partial: list[Sample] | None
    ) -> list[Sample] | None:
        """The group on `client`; None when the engine was marked down before it finished."""
        if self.health is None:
            return await self._group_on(client, prompt, draw, partial)
        task = asyncio.create_task(self._group_on(client, prompt, draw, partial))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.2)
                if done:
                    return task.result()
                if self.health.is_down(client.base_url):
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    return None
        except BaseException:  # the rollout is cancelling this group
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise

    async def _group_on(
        self, client: EngineClient, prompt: Prompt, draw: int, partial: list[Sample] | None = None
    ) -> list[Sample]:
        if not prompt.token_ids:
            raise ValueError(
                f"prompt {prompt.index} has no token ids: a list of chat messages reaches the built-in "
                "rollout only with --apply-chat-template"
            )
        n = self.sampling.n_samples_per_prompt
        params = [self.sampling.params() for _ in range(n)]
        if self.seed_keys is not None:
            from slime.utils.seed import sample_seed

            for k, p in enumerate(params):
                p["sampling_seed"] = sample_seed(*self.seed_keys, draw, k)
        # --multimodal-keys: the images go to the engine with the expanded ids, their tensors to
        # the trainer; made once for the group, shared by its samples.
        images = None
        if prompt.images:  # image work (resize, PNG) off the event loop
            images = await asyncio.to_thread(prompt_images, self.dataset.processor, list(prompt.images))
        image_data = images.image_data if images is not None else None
        if partial is None:
            samples = [
                Sample(
                    group_index=draw,  # numbered again, in the order the groups are kept
                    index=draw * n + k,  # unique in the rollout, as slime's data source numbers them
                    prompt=prompt.prompt,
                    label=prompt.label,
                    metadata=dict(prompt.metadata, prompt_index=prompt.index),
                    multimodal_inputs={"images": list(prompt.images)} if images is not None else None,
                    multimodal_train_inputs=images.train_inputs if images is not None else None,
                )
                for k in range(n)
            ]
            calls = [
                generate(client, s, prompt.token_ids, p, self.args, image_data)
                if self.generate_fn is None
                else self._custom(s, prompt, p, client)
                for s, p in zip(samples, params)
            ]
        else:
            samples = partial
            calls = [self._continue(s, p, client, image_data) for s, p in zip(samples, params)]
        with trace_span(samples, "generate_and_rm_group", attrs={"group_size": len(samples)}):
            return await self._run_group(samples, calls)

    async def _run_group(self, samples: list[Sample], calls: list[Any]) -> list[Sample]:
        """The group's generate calls (one per sample), then its reward (and the teacher's)."""
        results = await asyncio.gather(
            *(_traced(s, c) for s, c in zip(samples, calls)), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:  # every request of the group has ended: none is left running
            raise errors[0]
        if self.generate_fn is not None:  # a function may fan one sample out into several (slime's)
            for base, r in zip(samples, results):
                # One execution: its samples keep together through training. An id a function
                # set on a single sample is numbered too (a constant 0 must not merge executions).
                if isinstance(r, list) or (isinstance(r, Sample) and r.rollout_id is not None):
                    for s in r if isinstance(r, list) else [r]:
                        s.rollout_id = base.index
            samples = [
                s for r in results for s in (r if isinstance(r, list) else [r]) if isinstance(s, Sample)
            ]
        if any(s.status == Status.ABORTED for s in samples):
            return samples
        start = time.perf_counter()
        await score_unscored(self.reward, samples, "--custom-generate-function-path")
        if self.teacher is not None:
            await self.teacher.score(samples)
        self.progress.reward_seconds += time.perf_counter() - start
        return samples

    async def _continue(
        self,
        sample: Sample,
        params: dict[str, Any],
        client: EngineClient,
        image_data: list[str] | None = None,
    ) -> Sample | list[Sample]:
        """--partial-rollout: an aborted sample goes on from its tokens (a finished one is kept).
        With --mask-offpolicy-in-partial-rollout its tokens so far leave the loss first."""
        if sample.status != Status.ABORTED:
            return sample
        if self.mask_offpolicy and sample.response_length:
            sample.loss_mask = [0] * sample.response_length
        if self.generate_fn is None:
            return await continue_sample(client, sample, params, self.args, image_data)
        return await self._custom(
            sample, None, params, client
        )  # slime's: the function sees the partial sample

    async def _custom(
        self, sample: Sample, prompt: Prompt | None, params: dict[str, Any], client: EngineClient
    ) -> Sample | list[Sample]:
        """slime's custom generate signature: f(args, sample, sampling_params) -> Sample, or a
        list of Samples that all set `rollout_id` (one execution split into several training
        samples: an agent's sub-agents, slime's fan-out); the sample arrives with the prompt ids
        in `tokens`. It posts to
        `args.sglang_router_ip/port`: the router, or where there is none (torch engines), the
        engine this group was given (in a copy of args), so the groups spread over the engines."""
        assert self.generate_fn is not None
        if prompt is not None:
            sample.tokens = list(prompt.token_ids)
        args = self.args
        if self.route_to_engine and args is not None:
            args = copy.copy(args)
            args.sglang_router_ip, args.sglang_router_port = host_port(client.base_url)
        result = self.generate_fn(args, sample, dict(params))
        if asyncio.iscoroutine(result):
            result = await result
        if isinstance(result, list):
            if not result or not all(isinstance(s, Sample) and s.rollout_id is not None for s in result):
                raise TypeError(
                    "--custom-generate-function-path returned a list: it must be non-empty Samples that "
                    "all set rollout_id (the one execution they came from), as slime requires"
                )
            if len({s.rollout_id for s in result}) > 1:
                raise ValueError(
                    "--custom-generate-function-path returned samples of one execution with different "
                    f"rollout_ids {sorted({s.rollout_id for s in result})}: siblings must share one "
                    "(slime's rule)"
                )
            return result
        if not isinstance(result, Sample):
            raise TypeError(f"--custom-generate-function-path returned {type(result).__name__}, not a Sample")
        return result

    def live_clients(self) -> list[EngineClient]:
        if self.health is None:
            return self.clients
        return [self._client(u) for u in self.health.live()]

    async def generate_rollout(self) -> RolloutResult:
        kept: list[tuple[int, list[Sample]]] = []  # (draw order, group)
        drawn: dict[asyncio.Task, int] = {}
        prompts: dict[asyncio.Task, Prompt] = {}
        running: set[asyncio.Task] = set()
        started = filtered = aborted = surplus = 0
        reasons: dict[str, int] = {}

        def start(prompt: Prompt, partial: list[Sample] | None = None) -> None:
            nonlocal started
            task = asyncio.create_task(self.group(prompt, started, partial))
            drawn[task], prompts[task] = started, prompt
            running.add(task)
            started += 1

        carried = list(self.carry or ())
        if self.carry is not None:
            self.carry.clear()
        for prompt, partial in carried:  # cut off last time: continued first
            start(prompt, partial)
        finished_late: set[asyncio.Task] = set()
        failed = False
        try:
            while len(kept) < self.rollout_batch_size:
                if len(kept) + len(running) < self.rollout_batch_size or not running:
                    for prompt in self.dataset.next_batch(self.over_sampling_batch_size):
                        start(prompt)
                if self.seed_keys is None:
                    done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                else:  # deterministic: decide on groups in the order they were drawn
                    oldest = min(running, key=drawn.__getitem__)
                    await asyncio.wait({oldest})
                    done, running = {oldest}, running - {oldest}
                for task in done:
                    group = task.result()  # a failing generate or reward function ends the rollout
                    if len(kept) >= self.rollout_batch_size:
                        surplus += 1
                        if self.carry is not None:  # finished after enough were kept: the next rollout's
                            finished_late.add(task)
                        continue
                    if self.group_filter is not None:
                        verdict = as_filter_output(self.group_filter(self.args, group))
                        if drops(verdict, started - filtered, self.rollout_batch_size):
                            filtered += 1
                            if verdict.reason:
                                reasons[verdict.reason] = reasons.get(verdict.reason, 0) + 1
                            continue
                    kept.append((drawn[task], group))
                    self.progress.done += len(group)
        except BaseException:
            failed = True
            raise
        finally:
            aborted = len(running)
            await self._end(running, finished_late if not failed else None, drawn, prompts)
        # Groups finish in any order; numbered in the order their prompts were drawn, the same
        # prompts give the same rollout however the engines interleave them.
        kept.sort(key=lambda item: item[0])
        samples = number_groups(
            [group for _, group in kept], self.sampling.n_samples_per_prompt, "the rollout"
        )
        if filtered or aborted:
            logger.info(
                "rollout: %d prompts started, %d groups filtered, %d aborted", started, filtered, aborted
            )
        carrying = self.carry is not None
        return RolloutResult(
            samples,
            started,
            filtered,
            aborted,
            surplus,
            reasons,
            len(carried) if carrying else None,
            len(self.carry or ()) if carrying else None,
        )

    async def _end(
        self,
        running: set[asyncio.Task],
        finished_late: set[asyncio.Task] | None,
        drawn: dict[asyncio.Task, int],
        prompts: dict[asyncio.Task, Prompt],
    ) -> None:
        """End a rollout: abort the requests still running; with --partial-rollout keep their
        groups cut off, and those `finished_late`, for the next rollout (None: the rollout
        failed, nothing is kept); close the clients opened for it."""
        try:
            if running:
                await self._abort_all()
            if self.carry is not None and finished_late is not None and (running or finished_late):
                await self._keep_cut_off(running | finished_late, drawn, prompts)
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            await asyncio.gather(*(c.close() for c in self._opened))

    async def _abort_all(self) -> None:
        await asyncio.gather(
            *(c.abort_request(abort_all=True) for c in self.live_clients()), return_exceptions=True
        )

    async def _keep_cut_off(
        self, tasks: set[asyncio.Task], drawn: dict[asyncio.Task, int], prompts: dict[asyncio.Task, Prompt]
    ) -> None:
        """--partial-rollout: the groups over-sampling cut off (their requests were just aborted,
        or they finished after enough groups were kept) go to `carry` with what they generated,
        in draw order. A group that does not end within the client timeout (its engine is being
        restarted) is given up, as without the flag."""
        assert self.carry is not None
        deadline = time.monotonic() + max((c.config.timeout_s for c in self.clients), default=60.0)
        pending = set(tasks)
        while pending and time.monotonic() < deadline:
            _, pending = await asyncio.wait(pending, timeout=0.5)
            if pending:  # requests the client was still queueing reach the engine after an abort
                await self._abort_all()
        done = set(tasks) - pending
        for task in sorted(done, key=drawn.__getitem__):
            if not task.cancelled() and task.exception() is None:
                self.carry.append((prompts[task], task.result()))


async def _traced(sample: Sample, call: Any) -> Any:
    """One sample's generate call as slime's `generate_and_rm` span."""
    with trace_span(sample, "generate_and_rm"):
        return await call
