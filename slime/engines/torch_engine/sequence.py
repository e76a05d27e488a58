"""One generation request's state inside the torch engine (plain Python, no tensors)."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slime.engines.protocol import FinishReason, GenerateRequest, ProtocolError
from slime.engines.torch_engine.stop_watch import StopWatch
from slime.utils.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestTimes:
    """When one request reached each stage, in `time.perf_counter()` seconds (0.0: not reached).
    Set once per request (never per token): the server, the engine's add, its prefill and its
    finish each stamp one; SGLang's per-request timing fields and the Prometheus histograms are
    differences of these (slime.engines.torch_engine.results, .metrics)."""

    created: float = field(default_factory=time.perf_counter)
    """Received by the HTTP server, before tokenization (SGLang's `created_time`)."""
    queued: float = 0.0
    """Entered the engine's waiting queue (SGLang's `wait_queue_entry_time`)."""
    admitted: float = 0.0
    """First taken into a prefill (SGLang's `forward_entry_time`); a retracted request keeps it."""
    first_token: float = 0.0
    """Its first output token was sampled: the end of its first prefill."""
    finished: float = 0.0
    """The engine finished it (a stop, its length, or an abort)."""
    responded: float = 0.0
    """The server built its answer (where SGLang's `e2e_latency` ends)."""

    def mark_prefill(self, admitted: float, first_token: float) -> None:
        """A prefill that started at `admitted` sampled a token at `first_token`; only the first
        counts (a retracted request is prefilled again)."""
        if not self.admitted:
            self.admitted = admitted
        if not self.first_token:
            self.first_token = first_token


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
    stop_ids: frozenset[int] = frozenset()
    """The token ids that end it: its `stop_token_ids`, and the model's EOS ids unless `ignore_eos`
    (set by the scheduler when it is queued)."""
    stop_watch: StopWatch | None = None
    """With stop strings: what watches the output text for them (set when it is queued)."""
    # Where the stop string starts in the decoded text (for trimming), when one matched.
    stop_text_end: int | None = None
    # Per-backend state (e.g. the generic runner's per-sequence HF cache, a torch.Generator).
    runner_state: dict[str, Any] = field(default_factory=dict)
    lora_name: str | None = None
    """The LoRA adapter the request asked for (`lora_path`); None: the base model."""
    lora: Any = None
    """Its slime.engines.torch_engine.lora.Adapter while the sequence is in flight."""
    images: Any = None
    """A vision-language prompt's images: the processor's tensors
    (slime.engines.torch_engine.vision.ImageInputs), read once, at the first prefill."""
    weight_version: str = ""
    """The engine's weight version when the sequence finished (SGLang's meta_info field)."""
    version_spans: list[list[Any]] = field(default_factory=list)
    """[weight version, tokens] runs covering `output_ids` in order: which weights produced each
    token (a request that spans a weight update has several runs)."""

    num_versioned: int = 0
    """How many output tokens `version_spans` covers (kept, not summed: this runs every step)."""
    times: RequestTimes = field(default_factory=RequestTimes)

    def record_versions(self, version: str) -> None:
        """Attribute the output tokens not yet covered by a run to `version`."""
        new = len(self.output_ids) - self.num_versioned
        if new <= 0:
            return
        self.num_versioned += new
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


def check_request(
    req: GenerateRequest,
    ids: list[int],
    vocab_size: int,
    context_length: int,
    config: Any,
    no_routed_experts: str | None,
    lora: bool,
) -> None:
    """Raise ProtocolError naming the field of `req` (tokenized to `ids`) this engine cannot
    serve: token ids outside the vocabulary, a prompt plus max_new_tokens over the context
    length, more top log-probs than --max-top-logprobs-num, routed experts without
    --enable-return-routed-experts (or, `no_routed_experts`, a model without routers), an
    adapter without --enable-lora (`lora`), a logprob_start_len past the prompt."""
    if req.input_ids is not None:
        # An empty prefill would fail inside the engine step and abort every request in it.
        if not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ProtocolError("'input_ids' must be a non-empty list of integer token ids")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ProtocolError(
                f"'input_ids' holds token id(s) outside the vocabulary [0, {vocab_size}): {bad[:5]}"
            )
    params = req.sampling_params
    if len(ids) >= context_length:
        raise ProtocolError(
            f"the input ({len(ids)} tokens) is longer than the model's context length "
            f"({context_length} tokens)"
        )
    if len(ids) + params.max_new_tokens > context_length:
        raise ProtocolError(
            f"input ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the "
            f"model's context length ({context_length} tokens); lower max_new_tokens to "
            f"at most {context_length - len(ids)}"
        )
    if any(not 0 <= t < vocab_size for t in params.stop_token_ids):
        raise ProtocolError(f"'sampling_params.stop_token_ids' must lie in [0, {vocab_size})")
    limit = config.max_top_logprobs_num
    if req.top_logprobs_num > limit:
        raise ProtocolError(
            f"'top_logprobs_num' {req.top_logprobs_num} exceeds this server's limit of {limit} "
            "(--max-top-logprobs-num)"
        )
    if req.return_routed_experts:
        if not config.enable_return_routed_experts:
            raise ProtocolError(
                "'return_routed_experts' needs an engine started with --enable-return-routed-experts"
            )
        if no_routed_experts:
            raise ProtocolError(f"'return_routed_experts': {no_routed_experts}")
    if req.lora_path is not None and not lora:
        raise ProtocolError("'lora_path' needs an engine started with --enable-lora")
    if req.return_logprob and req.logprob_start_len >= len(ids):
        raise ProtocolError(
            f"'logprob_start_len' {req.logprob_start_len} must be below the input's length ({len(ids)} "
            "tokens)"
        )
