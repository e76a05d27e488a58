"""The continuous rollout source (--fully-async): a pool of prompt groups in flight that never
stops at a rollout boundary.

The pool lives on the rollout manager's background event loop. Finished groups wait in a queue;
each train step takes the next `--rollout-batch-size` of them (`take`), and the pool tops itself
up as groups finish, while the trainer trains and while a push pauses the engines.

Staleness, in weight versions (the trainer's version counts the steps trained):

- admission: with `--max-policy-version-lag N`, the groups admitted and not yet dropped never
  exceed (v - v0 + N + 1) * B, where v is the engines' version, v0 the version the pool started
  at and B the rollout batch size. A group admitted at version v is then among the groups the
  steps up to v + N take, when groups finish in the order they were admitted; with N = 0 one
  step's groups are all admitted at its version, as in the synchronous loop;
- the check at `take`: groups finish out of order (a long response), so each taken group's lag
  is measured: the trainer's version minus the oldest version among the tokens it trains on
  (loss mask 1). A group beyond N is requeued (its prompt generated again) or dropped,
  `--stale-group-action`. Where the engine reports no per-token versions (SGLang), a group's
  tokens count as old as the version it was admitted at (an upper bound of the lag).

A push pauses the requests in flight (--pause-generation-mode): `retract` and `in_place` keep
them in the engine (their later tokens come from the new weights); `abort` ends them with what
they made, and the pool continues them as new requests with `--partial-rollout`, or generates
their group again without it.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from slime.config.records import AsyncConfig
from slime.rollout.builtin_rollout import RolloutGenerator
from slime.rollout.data import Prompt, PromptDataset
from slime.rollout.filter_hub.base_types import as_filter_output, drops
from slime.utils.sample import Sample, Status

logger = logging.getLogger(__name__)

MAX_REQUEUES = 3
"""--stale-group-action requeue: a prompt stale this many times more is dropped (and reported)."""
LAG_HISTOGRAM = 8
"""Lags 0..7 get their own histogram bin (rollout/policy_lag_hist_<k>); larger ones share _8+."""


@dataclass
class Flight:
    """A prompt group in the pool: where it came from and the engines' version at admission."""

    prompt: Prompt
    draw: int
    admitted: int
    restarts: int = 0
    measured: bool = False
    oldest: int | None = None
    """The oldest weight version among its finished group's trained tokens, once `measured`."""


@dataclass
class Taken:
    """What one `take` hands to training, and the pool's metrics since the previous take."""

    groups: list[list[Sample]]
    metrics: dict[str, float] = field(default_factory=dict)


class ContinuousPool:
    """Keeps prompt groups in flight on the engines across rollouts (see the module docstring).

    `gen` makes one group (engine choice, custom generate function, rewards, fault tolerance);
    `cap` bounds the groups in flight and the finished ones waiting (slime's pool size);
    `exact_versions`: the engines report the weights of every token (the torch engine)."""

    def __init__(
        self,
        gen: RolloutGenerator,
        dataset: PromptDataset,
        cfg: AsyncConfig,
        batch_size: int,
        cap: int,
        version: int,
        group_filter: Any = None,
        exact_versions: bool = True,
    ):
        self.gen, self.dataset, self.cfg = gen, dataset, cfg
        self.batch_size, self.cap = batch_size, max(cap, batch_size)
        self.version = self.start_version = version
        self.group_filter = group_filter
        self.exact_versions = exact_versions
        self.taken = 0
        self.requeued: list[Prompt] = []
        self.requeues: Counter[int] = Counter()
        """Times each prompt (by index) went stale and was requeued (see `_stale`)."""
        self.given_up = 0
        """Prompts dropped after MAX_REQUEUES requeues."""
        self.flights: dict[asyncio.Task[list[Sample]], Flight] = {}
        self.done: list[tuple[Flight, list[Sample]]] = []
        self.draws = 0
        self.counts: Counter[str] = Counter()
        self.error: BaseException | None = None
        self._changed: asyncio.Event | None = None
        self._closed = False

    # ---- admission ------------------------------------------------------------------------
    def admission_limit(self) -> int | None:
        """The most groups that may be open (in flight or finished, not taken) now."""
        if self.cfg.max_lag is None:
            return None
        return (self.version - self.start_version + self.cfg.max_lag + 1) * self.batch_size - self.taken

    def set_version(self, version: int) -> None:
        """The engines now have `version` (after a push): more groups may be admitted."""
        self.version = version
        self.top_up()

    def top_up(self) -> None:
        """Start groups until the pool is full or the admission bound is reached (loop thread)."""
        limit = self.admission_limit()
        while (
            not self._closed
            and self.error is None
            and len(self.flights) < self.cap
            and len(self.done) < self.cap
        ):
            if limit is not None and len(self.flights) + len(self.done) >= limit:
                break
            prompt = self.requeued.pop(0) if self.requeued else self.dataset.next_batch(1)[0]
            self._launch(Flight(prompt, self.draws, self.version))
            self.draws += 1

    def _launch(self, flight: Flight, partial: list[Sample] | None = None) -> None:
        task = asyncio.get_running_loop().create_task(self._fly(flight, partial))
        self.flights[task] = flight
        task.add_done_callback(self._landed)

    async def _fly(self, flight: Flight, partial: list[Sample] | None) -> list[Sample]:
        """The group, continued or generated again until no sample of it is aborted (a push in
        abort mode interrupts it)."""
        group = await self.gen.group(flight.prompt, flight.draw, partial)
        while any(s.status == Status.ABORTED for s in group):
            flight.restarts += 1
            if self.cfg.partial:
                self.counts["continued_requests"] += sum(s.status == Status.ABORTED for s in group)
                group = await self.gen.group(flight.prompt, flight.draw, group)
            else:
                self.counts["restarted_groups"] += 1
                flight.admitted = self.version
                group = await self.gen.group(flight.prompt, flight.draw)
        for s in group:
            s.metadata["admitted_weight_version"] = flight.admitted
        return group

    def _landed(self, task: asyncio.Task[list[Sample]]) -> None:
        flight = self.flights.pop(task)
        if task.cancelled():
            return
        error = task.exception()
        if error is not None:
            if self.error is None:  # a failing generate or reward function ends the job, as in a rollout
                self.error = error
            self._notify()
            return
        group = task.result()
        if self.group_filter is not None:
            verdict = as_filter_output(self.group_filter(self.gen.args, group))
            candidates = self.taken + len(self.done) + len(self.flights) + 1
            wanted = self.taken + self.batch_size
            if drops(verdict, candidates, wanted):
                self.requeues.pop(flight.prompt.index, None)  # no longer stale: filtered
                self.counts["filtered"] += 1
                if verdict.reason:
                    self.counts[f"drop_{verdict.reason}"] += 1
                self.top_up()
                return
        self.done.append((flight, group))
        self._notify()
        self.top_up()

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    # ---- taking ---------------------------------------------------------------------------
    def lag(self, flight: Flight, group: list[Sample], trainer_version: int) -> int:
        """The trainer's version minus the oldest version among the group's trained tokens
        (measured once per finished group: `take` asks for every waiting group at every pick)."""
        if not flight.measured:
            flight.oldest, flight.measured = self._oldest(flight, group), True
        return 0 if flight.oldest is None else trainer_version - flight.oldest

    def _oldest(self, flight: Flight, group: list[Sample]) -> int | None:
        oldest = None
        for s in group:
            versions = s.token_weight_versions() if self.exact_versions else None
            mask = s.loss_mask if s.loss_mask is not None else [1] * s.response_length
            trained = [_as_int(v) for v, m in zip(versions, mask) if m] if versions is not None else [None]
            if None in trained:
                seen = [flight.admitted]  # unknown per token: as old as its admission
            else:
                seen = [v for v in trained if v is not None]
            if seen:
                oldest = min(seen) if oldest is None else min(oldest, *seen)
        return oldest

    async def take(self, trainer_version: int) -> Taken:
        """The next `batch_size` finished groups within the lag bound, the oldest first, for
        training at `trainer_version`."""
        if self._changed is None:
            self._changed = asyncio.Event()
        self.top_up()
        out: list[list[Sample]] = []
        lags: list[int] = []
        in_flight = len(self.flights)
        while len(out) < self.batch_size:
            while not self.done:
                if self.error is not None:
                    raise self.error
                if not self.flights:
                    self.top_up()
                    if not self.flights:
                        raise RuntimeError(
                            "the continuous rollout has no group in flight and may admit none "
                            f"(engines at version {self.version}, {self.taken} groups taken)"
                        )
                self._changed.clear()
                await self._changed.wait()
            # The oldest first (the largest lag; among equals, the first finished): a group near
            # the bound is trained before it goes stale, while fresher ones can still wait. Taken
            # first finished, first taken, a long response finishes behind groups admitted after
            # it and goes stale in the queue.
            lags_now = [self.lag(f, g, trainer_version) for f, g in self.done]
            pick = max(range(len(self.done)), key=lambda k: (lags_now[k], -k))
            flight, group = self.done.pop(pick)
            lag = lags_now[pick]
            if self.cfg.max_lag is not None and lag > self.cfg.max_lag:
                self._stale(flight.prompt, lag)
                self.top_up()
                continue
            out.append(group)
            lags.append(lag)
            self.requeues.pop(flight.prompt.index, None)
            self.taken += 1  # at once: a group landing meanwhile must not take its admission slot
        self.top_up()
        return Taken(out, self._metrics(lags, in_flight))

    def _stale(self, prompt: Prompt, lag: int) -> None:
        """A group beyond the bound: its prompt is requeued (generated again), at most
        MAX_REQUEUES times, or dropped. A prompt whose responses always take longer than the bound
        to generate would otherwise be requeued forever, and a few of them could fill every
        admission slot and stop training."""
        if self.cfg.stale_action == "requeue" and self.requeues[prompt.index] < MAX_REQUEUES:
            self.requeues[prompt.index] += 1
            self.requeued.append(prompt)
            self.counts["stale_groups_requeued"] += 1
            return
        self.counts["stale_groups_dropped"] += 1
        if self.requeues.pop(prompt.index, None) is not None:
            self.given_up += 1
            logger.warning(
                "prompt %d went stale %d times in a row (lag %d > --max-policy-version-lag %d): dropped. Its "
                "responses take longer to generate than the bound allows, so long responses are "
                "under-represented in training; raise --max-policy-version-lag to keep them",
                prompt.index,
                MAX_REQUEUES + 1,
                lag,
                self.cfg.max_lag,
            )

    def _metrics(self, lags: list[int], in_flight: int) -> dict[str, float]:
        m: dict[str, float] = {
            "rollout/policy_lag_mean": sum(lags) / len(lags),
            "rollout/policy_lag_max": float(max(lags)),
            "rollout/in_flight_groups": float(in_flight),
            "rollout/finished_groups_waiting": float(len(self.done)),
            "rollout/stale_prompts_given_up": float(self.given_up),
        }
        hist = Counter(min(lag, LAG_HISTOGRAM) for lag in lags)
        for k in range(LAG_HISTOGRAM + 1):
            name = f"rollout/policy_lag_hist_{k}" if k < LAG_HISTOGRAM else f"rollout/policy_lag_hist_{k}+"
            m[name] = float(hist.get(k, 0))
        for key in (
            "stale_groups_requeued",
            "stale_groups_dropped",
            "continued_requests",
            "restarted_groups",
        ):
            m[f"rollout/{key}"] = float(self.counts.pop(key, 0))
        if self.counts.get("filtered"):
            for key in [k for k in self.counts if k.startswith("drop_")]:
                m[f"rollout/dynamic_filter/{key}"] = float(self.counts.pop(key))
            m["rollout/dynamic_filter/filtered_groups"] = float(self.counts.pop("filtered"))
        return m

    # ---- checkpoints and shutdown ------------------------------------------------------------
    def pending_prompts(self) -> list[Prompt]:
        """Prompts drawn and not taken (requeued, finished and waiting, in flight), in draw order:
        a checkpoint returns them to the data source so a resumed run draws them first."""
        open_ = [(f.draw, f.prompt) for f, _ in self.done] + [
            (f.draw, f.prompt) for f in self.flights.values()
        ]
        return list(self.requeued) + [p for _, p in sorted(open_, key=lambda x: x[0])]

    async def close(self) -> None:
        """Stop admitting, abort what is in flight on the engines and forget it."""
        self._closed = True
        tasks = list(self.flights)
        if tasks:
            await asyncio.gather(
                *(c.abort_request(abort_all=True) for c in self.gen.live_clients()), return_exceptions=True
            )
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(c.close() for c in self.gen.clients), return_exceptions=True)


def _as_int(version: str | None) -> int | None:
    """A weight version as the trainer counts it (None: no version, or an engine's own name such
    as SGLang's "default" before the first push)."""
    try:
        return int(version) if version is not None else None
    except ValueError:
        return None
