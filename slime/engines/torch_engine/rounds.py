"""Decode rounds on the device: several decode steps per host round trip, overlapped with booking.

Without this, every decode step ends with the device idle: the host waits for the step's tokens,
appends them to each sequence, checks stop conditions, finishes requests, builds the next step's
inputs and only then launches it. Two things take that work off the device's critical path:

* Rounds (`--num-continuous-decode-steps K`, SGLang's flag): K decode steps launched back to back,
  each step's input tokens taken on the device from the step before, the sampled tokens and their
  log-probs kept on the device and brought down in one copy at the end of the round. A sequence
  that stops inside a round (a stop token) runs on to the round's end; the tokens sampled after its
  stop are dropped when the round is booked. A round never takes a sequence past its
  max_new_tokens (so its positions stay inside the context and the cache): K shrinks near a
  sequence's end, down to one step.
* Overlap (SGLang's overlap schedule, on by default on CUDA): round R+1 is launched before round R
  is booked, its first input tokens taken on the device from round R's last. A sequence that
  finished in round R was still in round R+1: its tokens are dropped when round R+1 is booked, and
  its KV row is released after round R+1 in stream order.

Anything else the engine does between steps (admitting requests, commands such as abort, pause or
a weight update, a step that needs top log-probs or routed experts) first books the round in
flight (`drain`), so it sees the state it would see with one step at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slime.engines.torch_engine.sampling import BatchSampling, pack, sample_on_device
from slime.engines.torch_engine.sequence import SeqStatus, Sequence
from slime.utils import transfer


@dataclass
class PendingRound:
    """A round of decode steps launched but not yet booked."""

    seqs: list[Sequence]
    last_tokens: torch.Tensor
    """The last step's sampled token ids (int64, on the device): the next round's inputs."""
    copy: transfer.HostCopy
    """Every step's tokens and log-probs on their way to the host ([2, steps, rows], sampling.pack)."""
    num_steps: int


class DecodeRounds:
    """The decode rounds of one engine (slime.engines.torch_engine.engine.TorchEngine).

    Args:
        engine: the engine (its runner, scheduler, generator and finish path).
        steps: the most decode steps per round (`--num-continuous-decode-steps`).
        overlap: launch each round before booking the one before it.
    """

    def __init__(self, engine: Any, steps: int, overlap: bool):
        self.engine = engine
        self.steps = steps
        self.overlap = overlap
        self.pending: PendingRound | None = None
        self._sampling: tuple[list[Sequence], BatchSampling] | None = None
        """The last batch's sampling settings, reused while the batch is the same."""

    @staticmethod
    def takes(seqs: list[Sequence]) -> bool:
        """Whether decode steps over `seqs` can run as a round: nothing per step that the host
        must see before the next launch (top log-probs, routed experts, LoRA rows)."""
        return all(not s.top_logprobs_num and not s.return_routed_experts and s.lora is None for s in seqs)

    def round_size(self, seqs: list[Sequence]) -> int:
        """How many steps the next round over `seqs` runs: at most `steps`, and no sequence past
        its max_new_tokens, counting the tokens of the round in flight; one where a sequence has
        all of its tokens in flight already (fed once more, as overlap does: still inside the
        context, and the token dropped)."""
        if self.steps == 1:
            return 1
        in_flight = self.pending.num_steps if self.pending is not None else 0
        room = min(s.params.max_new_tokens - len(s.output_ids) for s in seqs) - in_flight
        return max(1, min(self.steps, room))

    def step(self) -> None:
        """Launch a round over the running batch, then book the one before it (or, without
        overlap, this one)."""
        engine, prev = self.engine, self.pending
        seqs = list(engine.runner.active)
        num_steps = self.round_size(seqs)
        same_rows = list(range(len(seqs)))
        source = None
        if prev is not None:  # the rows of the round before, where the batch changed since
            index = same_rows if prev.seqs == seqs else {id(s): i for i, s in enumerate(prev.seqs)}
            source = (prev.last_tokens, same_rows if index is same_rows else [index[id(s)] for s in seqs])
        batch = self._batch_sampling(seqs)
        tokens_steps, logprob_steps = [], []
        for _ in range(num_steps):
            _, logits = engine.runner.decode(source)
            tokens, chosen, _ = sample_on_device(logits, batch, engine.generator)
            tokens_steps.append(tokens)
            logprob_steps.append(chosen)
            source = (tokens, same_rows)
        copy = transfer.to_host_async(pack(torch.stack(tokens_steps), torch.stack(logprob_steps)))
        self.pending = PendingRound(seqs, tokens_steps[-1], copy, num_steps)
        if prev is not None:
            self._book(prev)
        if not self.overlap:
            self.drain()

    def _batch_sampling(self, seqs: list[Sequence]) -> BatchSampling:
        if self._sampling is None or self._sampling[0] != seqs:
            engine = self.engine
            gens = [s.runner_state.get("generator") for s in seqs]
            batch = BatchSampling.of([s.params for s in seqs], gens, engine.device)
            self._sampling = (seqs, batch)
        return self._sampling[1]

    def drain(self) -> None:
        """Book the round in flight, if any."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self._book(pending)

    def drop(self) -> None:
        """Forget the round in flight (the engine failed it and reset the runner)."""
        self.pending = None

    def _book(self, step: PendingRound) -> None:
        engine = self.engine
        host = step.copy.wait()
        tokens = host[0].long().t().tolist()  # per sequence, its run of tokens
        logprobs = host[1].t().tolist()
        seqs = step.seqs
        if any(s.status is SeqStatus.FINISHED for s in seqs):
            # Finished (stopped, or aborted) after this round was launched: their tokens are dropped.
            live = [i for i, s in enumerate(seqs) if s.status is not SeqStatus.FINISHED]
            seqs, tokens, logprobs = (
                [seqs[i] for i in live],
                [tokens[i] for i in live],
                [logprobs[i] for i in live],
            )
        scheduler = engine.scheduler
        before = scheduler.num_appended
        finished = scheduler.append_runs(seqs, tokens, logprobs)
        engine.num_steps += step.num_steps
        engine.num_generated_tokens += scheduler.num_appended - before
        engine._finish(finished)
