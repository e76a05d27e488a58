"""One generation request's state inside the torch engine (plain Python, no tensors)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slime.engines.protocol import FinishReason, SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """A prompt and the tokens generated for it so far.

    `num_cached` counts the tokens whose keys/values are in the KV cache; the next forward
    feeds the tokens after that point. `on_finish` is called exactly once, from the engine
    thread, with the finished sequence.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    on_finish: Callable[[Sequence], None] | None = None
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    return_routed_experts: bool = False
    routed_experts: list[Any] = field(default_factory=list)
    """With `return_routed_experts`: [tokens, layers, top-k] int32 tensors, in order, covering
    every token fed to the model so far (the runner writes them; see BatchedRunner)."""
    logprob_start_len: int = -1
    """With `return_logprob` and >= 0: the input tokens from here on get their log-probs."""
    return_text_in_logprobs: bool = False
    input_logprobs: list[float | None] | None = None
    """The log-prob of each input token from `logprob_start_len` on (None for the first, as
    SGLang reports), computed when the request is admitted."""
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: FinishReason | None = None
    num_cached: int = 0
    # Where the stop string starts in the decoded text (for trimming), when one matched.
    stop_text_end: int | None = None
    # Per-backend state (e.g. the generic runner's per-sequence HF cache, a torch.Generator).
    runner_state: dict[str, Any] = field(default_factory=dict)
    lora_name: str | None = None
    """The LoRA adapter the request asked for (`lora_path`); None: the base model."""
    lora: Any = None
    """Its slime.engines.torch_engine.lora.Adapter while the sequence is in flight."""
    weight_version: str = ""
    """The engine's weight version when the sequence finished (SGLang's meta_info field)."""
    version_spans: list[list[Any]] = field(default_factory=list)
    """[weight version, tokens] runs covering `output_ids` in order: which weights produced each
    token (a request that spans a weight update has several runs)."""

    def record_versions(self, version: str) -> None:
        """Attribute the output tokens not yet covered by a run to `version`."""
        covered = sum(n for _, n in self.version_spans)
        new = len(self.output_ids) - covered
        if new <= 0:
            return
        if self.version_spans and self.version_spans[-1][0] == version:
            self.version_spans[-1][1] += new
        else:
            self.version_spans.append([version, new])

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED
