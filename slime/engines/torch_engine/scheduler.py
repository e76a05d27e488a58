"""Continuous-batching scheduler of the torch engine: which sequences run in the next step.

Plain Python with no tensors, so its decisions are unit-testable anywhere. Each engine step is
either a prefill of newly admitted sequences or one decode token for every running sequence.
New arrivals are admitted at the next step boundary (they join the running batch while others
decode); a sequence that finishes leaves the batch in the step that finished it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from slime.engines.protocol import FinishReason
from slime.engines.torch_engine.sequence import SeqStatus, Sequence
from slime.engines.torch_engine.stop_watch import StopWatch

WatchStops = Callable[[tuple[str, ...], bool], StopWatch]
"""(stop strings, skip_special_tokens) -> the StopWatch of one sequence."""


@dataclass
class EngineStep:
    """What the next engine step does: prefill `seqs`, or decode `seqs` (the running batch)."""

    kind: str  # "prefill" | "decode"
    seqs: list[Sequence]


class Scheduler:
    """Admission, step planning, finish detection and abort for the running batch.

    Args:
        max_running: the most sequences decoding at once (`--max-running-requests`).
        max_prefill_tokens: token budget of one prefill step (padded length x batch).
        eos_token_ids: ids that end a sequence unless `ignore_eos`.
        detokenize: ids -> text, where a stop string is placed in the output.
        watch_stops: a sequence's StopWatch (default: one over `detokenize`); the engine's decodes
            with the tokenizer's own decoder, without the Python wrapper.
    """

    def __init__(
        self,
        max_running: int,
        max_prefill_tokens: int,
        eos_token_ids: set[int],
        detokenize: Callable[[list[int], bool], str],
        watch_stops: WatchStops | None = None,
    ):
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.detokenize = detokenize
        self.watch_stops = watch_stops or (
            lambda stops, skip: StopWatch(lambda ids: detokenize(ids, skip), stops)
        )
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # In-flight sequences by rid: the engine refuses a second request with a rid in here.
        self._by_rid: dict[str, Sequence] = {}
        self.num_appended = 0
        """Tokens recorded by append_runs so far (the decode rounds' count)."""

    # ---- queue ----------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        params = seq.params
        seq.stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else self.eos_token_ids
        )
        if params.stop:
            seq.stop_watch = self.watch_stops(tuple(params.stop), params.skip_special_tokens)
        self.waiting.append(seq)
        self._by_rid[seq.rid] = seq

    def is_in_flight(self, rid: str) -> bool:
        return rid in self._by_rid

    @property
    def num_in_flight(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admits(self) -> bool:
        """Whether the next plan admits waiting sequences (a prefill)."""
        return bool(self.waiting) and len(self.running) < self.max_running

    def plan(self) -> EngineStep | None:
        """Prefill waiting sequences while there is room; otherwise decode the running batch."""
        room = self.max_running - len(self.running)
        if self.admits():
            admitted: list[Sequence] = []
            longest = 0
            while self.waiting and len(admitted) < room:
                nxt = self.waiting[0]
                new_longest = max(longest, nxt.num_tokens)
                # Always admit at least one, even if its prompt alone exceeds the budget.
                if admitted and new_longest * (len(admitted) + 1) > self.max_prefill_tokens:
                    break
                admitted.append(self.waiting.popleft())
                longest = new_longest
            for seq in admitted:
                seq.status = SeqStatus.RUNNING
            self.running.extend(admitted)
            return EngineStep("prefill", admitted)
        if self.running:
            return EngineStep("decode", list(self.running))
        return None

    def retract(self, seqs: list[Sequence]) -> None:
        """Running sequences (their KV state already released) wait again, first in line, in order."""
        for seq in reversed(seqs):
            self.running.remove(seq)
            seq.status = SeqStatus.WAITING
            self.waiting.appendleft(seq)

    # ---- after a step ----------------------------------------------------------------------
    def append_tokens(
        self,
        seqs: list[Sequence],
        tokens: list[int],
        logprobs: list[float],
        top_logprobs: list[list[tuple[float, int]]] | None,
    ) -> list[Sequence]:
        """Record one sampled token per sequence; return those that finished with it."""
        finished = []
        for i, seq in enumerate(seqs):
            seq.output_ids.append(tokens[i])
            seq.output_logprobs.append(logprobs[i])
            if seq.top_logprobs_num and top_logprobs is not None:
                seq.output_top_logprobs.append(top_logprobs[i][: seq.top_logprobs_num])
            reason = self._finish_reason(seq)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def append_runs(
        self, seqs: list[Sequence], runs: list[list[int]], logprobs: list[list[float]]
    ) -> list[Sequence]:
        """Record a run of sampled tokens per sequence (several decode steps' worth, in order)
        and return the sequences that finished. A sequence keeps its run up to the token that
        finishes it; the rest was sampled past its end and is dropped."""
        finished = []
        for seq, run, values in zip(seqs, runs, logprobs):
            reason = self._append_run(seq, run, values)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    def _append_run(self, seq: Sequence, run: list[int], logprobs: list[float]) -> FinishReason | None:
        params = seq.params
        if params.stop:  # stop strings: the text must be checked after every token
            for token, value in zip(run, logprobs):
                seq.output_ids.append(token)
                seq.output_logprobs.append(value)
                self.num_appended += 1
                reason = self._finish_reason(seq)
                if reason is not None:
                    return reason
            return None
        # Token ids and length only: cut the run where it ends, with list operations (this runs
        # for every sequence after every decode round, so per-token Python is what it avoids).
        room = params.max_new_tokens - len(seq.output_ids)
        if len(run) > room:
            run, logprobs = run[:room], logprobs[:room]
        stop_at = None
        if not seq.stop_ids.isdisjoint(run):
            stop_at = next(j for j, token in enumerate(run) if token in seq.stop_ids)
            run, logprobs = run[: stop_at + 1], logprobs[: stop_at + 1]
        seq.output_ids += run
        seq.output_logprobs += logprobs
        self.num_appended += len(run)
        if stop_at is not None:
            return FinishReason("stop", matched=run[stop_at])
        if len(run) == room:
            return FinishReason("length", length=len(seq.output_ids))
        return None

    def _finish_reason(self, seq: Sequence) -> FinishReason | None:
        token = seq.output_ids[-1]
        params = seq.params
        if token in seq.stop_ids:
            return FinishReason("stop", matched=token)
        if seq.stop_watch is not None and seq.stop_watch.push(token):
            text = self.detokenize(seq.output_ids, params.skip_special_tokens)
            hits = [(text.find(s), s) for s in params.stop if s in text]
            if hits:
                pos, stop = min(hits)
                seq.stop_text_end = len(text) if params.no_stop_trim else pos
                return FinishReason("stop", matched=stop)
        if len(seq.output_ids) >= params.max_new_tokens:
            return FinishReason("length", length=len(seq.output_ids))
        return None

    def finish_without_decoding(self, seq: Sequence) -> None:
        """A request with max_new_tokens == 0 finishes before any forward pass."""
        self._finish(seq, FinishReason("length", length=0))

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish_reason = reason
        seq.status = SeqStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        if self._by_rid.get(seq.rid) is seq:
            del self._by_rid[seq.rid]

    # ---- abort -----------------------------------------------------------------------------
    def abort(self, rid: str | None, message: str) -> list[Sequence]:
        """Abort one request by rid, or every request when rid is None; return the aborted."""
        if rid is None:
            return self.abort_sequences(list(self.waiting) + self.running, message)
        seq = self._by_rid.get(rid)
        return self.abort_sequences([seq] if seq is not None else [], message)

    def abort_sequences(self, seqs: list[Sequence], message: str) -> list[Sequence]:
        """Abort exactly these sequences (by identity) if still in flight; return the aborted.

        A client that goes away aborts its own Sequence objects, never "whatever has its rid":
        by then its request may have finished and a new one may carry the same rid.
        """
        victims = [s for s in seqs if s in self.running or s in self.waiting]
        for seq in victims:
            if seq in self.waiting:
                self.waiting.remove(seq)
            self._finish(seq, FinishReason("abort", message=message))
        return victims
