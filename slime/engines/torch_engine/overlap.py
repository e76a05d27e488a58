"""Overlapped decoding: the device computes step N+1 while the host books step N's tokens.

Without it, every decode step ends with the device idle: the host waits for the step's tokens,
appends them to each sequence, checks stop conditions and finishes requests, and only then builds
and launches the next step. SGLang's overlap schedule hides that work; so does this, with one step
in flight:

1. launch step N+1 over the running batch, its input tokens taken on the device from step N's
   sampled tokens (the host has not seen them yet);
2. book step N: wait for its copy down, append its tokens, finish the sequences that stopped.

A sequence that stopped at step N was still in step N+1's batch: its extra token is dropped when
step N+1 is booked (it is already finished), and its KV row is released after step N+1 in stream
order. Anything else the engine does between steps (admitting requests, commands such as abort,
pause or a weight update, a step that needs top log-probs or routed experts) first books the step
in flight (`drain`), so it sees the state it would see without overlap.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from slime.engines.torch_engine import transfer
from slime.engines.torch_engine.sampling import pack, sample_on_device, unpack
from slime.engines.torch_engine.sequence import Sequence


@dataclass
class PendingStep:
    """A decode step launched but not yet booked."""

    seqs: list[Sequence]
    tokens: torch.Tensor
    """Its sampled token ids (int64, on the device): the next step's inputs."""
    copy: transfer.HostCopy
    """Tokens and their log-probs on their way to the host (sampling.pack)."""


class OverlapSchedule:
    """The step in flight, for one engine (slime.engines.torch_engine.engine.TorchEngine)."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.pending: PendingStep | None = None

    @staticmethod
    def takes(seqs: list[Sequence]) -> bool:
        """Whether a decode step over `seqs` can run overlapped: nothing per step that the host
        must see before the next launch (top log-probs, routed experts, LoRA rows)."""
        return all(not s.top_logprobs_num and not s.return_routed_experts and s.lora is None for s in seqs)

    def step(self) -> None:
        """Launch a decode step over the running batch, then book the one before it."""
        engine, prev = self.engine, self.pending
        source = None
        if prev is not None:
            index = {id(s): i for i, s in enumerate(prev.seqs)}
            source = (prev.tokens, [index[id(s)] for s in engine.runner.active])
        seqs, logits = engine.runner.decode(source)
        gens = [s.runner_state.get("generator") for s in seqs]
        tokens, chosen, _ = sample_on_device(logits, [s.params for s in seqs], gens, engine.generator)
        self.pending = PendingStep(seqs, tokens, transfer.to_host_async(pack(tokens, chosen)))
        if prev is not None:
            self._book(prev)

    def drain(self) -> None:
        """Book the step in flight, if any."""
        pending, self.pending = self.pending, None
        if pending is not None:
            self._book(pending)

    def drop(self) -> None:
        """Forget the step in flight (the engine failed it and reset the runner)."""
        self.pending = None

    def _book(self, step: PendingStep) -> None:
        engine = self.engine
        tokens, logprobs = unpack(step.copy.wait())
        # A sequence that finished (stopped, or was aborted) after this step was launched: its
        # token is dropped.
        live = [i for i, s in enumerate(step.seqs) if not s.is_finished]
        seqs = [step.seqs[i] for i in live]
        finished = engine.scheduler.append_tokens(
            seqs, [tokens[i] for i in live], [logprobs[i] for i in live], None
        )
        for s in seqs:
            s.record_versions(engine.weight_version)
        engine.num_steps += 1
        engine.num_generated_tokens += len(seqs)
        engine._finish(finished)
