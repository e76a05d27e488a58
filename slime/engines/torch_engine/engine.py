"""The torch engine's core: one thread that owns the model and runs the step loop.

Every state change (new requests, abort, pause, weight updates, memory release) is a command
executed by the engine thread between two steps, so a forward pass never sees half-updated
weights and no lock is needed around the model. HTTP handlers submit commands and await their
results; finished sequences are delivered through a callback.

A failed step or callback fails only the requests it touches; if the thread dies anyway, the
engine records why (`dead_reason`), fails every queued command and tells its death listeners,
so no caller waits forever on a thread that is gone.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from slime.engines.protocol import GenerateRequest, ProtocolError
from slime.engines.torch_engine.config import EngineConfig
from slime.engines.torch_engine.lora import ServedAdapters
from slime.engines.torch_engine.metrics import EngineLoad, EngineMetrics, EngineTimeline
from slime.engines.torch_engine.model_runner import BatchedRunner, load_model, make_runner
from slime.engines.torch_engine.profile_api import EngineProfiler
from slime.engines.torch_engine.prompt_logprobs import input_log_probs
from slime.engines.torch_engine.rounds import DecodeRounds
from slime.engines.torch_engine.runner import GenericRunner
from slime.engines.torch_engine.sampling import sample
from slime.engines.torch_engine.scheduler import Scheduler
from slime.engines.torch_engine.sequence import Sequence, check_request
from slime.engines.torch_engine.tokens import SharedTokenizer
from slime.engines.torch_engine.vision import BatchedVisionRunner, ImagePreparer, VisionRunner
from slime.engines.torch_engine.weights import WeightStore

logger = logging.getLogger(__name__)


class TorchEngine:
    """Continuous-batching generation over a Hugging Face causal LM."""

    def __init__(self, config: EngineConfig):

        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        if config.deterministic:
            from slime.utils.seed import enable_deterministic

            enable_deterministic(config.random_seed)
        self.device = torch.device(config.device)
        dtype = getattr(torch, config.dtype)
        self.model: Any = load_model(config.model_path, dtype, self.device)
        self.tokens = SharedTokenizer(config.model_path, self.model)
        model_config = self.model.config.get_text_config()
        self.vocab_size = int(model_config.vocab_size)
        self.context_length = int(
            config.context_length or getattr(model_config, "max_position_embeddings", None) or 4096
        )
        # A vision-language model: its images' processor, and its placeholders, never sampled.
        self.images = ImagePreparer.of(config.model_path, self.model.config)
        self.never_sampled = self.images.placeholder_ids if self.images is not None else None
        vision = self.images is not None
        self.runner = make_runner(
            self.model,
            config.max_running_requests,
            self.context_length,
            config.deterministic,
            cuda_graph_max_bs=0 if config.disable_cuda_graph else config.cuda_graph_max_bs,
            attention_backend=config.attention_backend,
            torch_compile_max_bs=config.torch_compile_max_bs if config.enable_torch_compile else 0,
            batched=BatchedVisionRunner if vision else None,
            generic=VisionRunner if vision else GenericRunner,
        )
        self.weights = WeightStore(self.model)
        self.rounds = self._decode_rounds()
        self.adapters: ServedAdapters | None = None
        if config.enable_lora:
            unapplied = getattr(self.runner, "unapplied_linears", ())
            self.adapters = ServedAdapters(self.model, config.max_loaded_loras, unapplied)
            self.runner.adapters = self.adapters
            for name, path in config.lora_paths:
                self.adapters.load_dir(name, path)
        self.scheduler = Scheduler(
            config.max_running_requests,
            config.max_prefill_tokens,
            self.tokens.eos_token_ids,
            self.tokens.decode,
            self.tokens.watch_stops,
        )
        self.generator = torch.Generator(device=self.device).manual_seed(config.random_seed)
        self._weight_version = config.weight_version
        self.paused = False
        self.busy_seconds = 0.0
        """Wall seconds spent in forward steps since start (an engine busy share is its rate)."""
        self._commands: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.SimpleQueue()
        )
        self._wakeup = threading.Event()
        # Guards the hand-over between call() and a dying thread: a command is either queued
        # before the queue is drained for good, or refused.
        self._commands_lock = threading.Lock()
        self.dead_reason: str | None = None
        self._death_listeners: list[Callable[[str], None]] = []
        # Set when releasing a sequence's KV state failed: the runner's rows no longer match.
        self._runner_suspect = False
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="torch-engine", daemon=True)
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.metrics = EngineMetrics(config.model_path, self.current_load)
        """This engine's Prometheus metrics (GET /metrics; the HTTP front observes its requests)."""
        self.timeline = EngineTimeline()  # its row of the job's timeline (--trace-dir)
        self.profiler = EngineProfiler(self.device.type)
        """/start_profile's torch.profiler window over engine steps."""

    def _decode_rounds(self) -> DecodeRounds | None:
        """How the batched runner decodes: rounds of several steps, overlapped with booking the
        last round's tokens (on CUDA by default); None: a step at a time, in the loop."""
        config = self.config
        overlap = config.overlap_schedule
        if overlap is None:
            overlap = self.device.type == "cuda" and not config.deterministic
        steps = config.num_continuous_decode_steps
        batched = isinstance(self.runner, BatchedRunner) and not config.deterministic
        if steps > 1 and not batched:
            logger.warning("--num-continuous-decode-steps %d: this runner decodes one step at a time", steps)
        return DecodeRounds(self, steps, overlap) if batched and (overlap or steps > 1) else None

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wakeup.set()
        self._thread.join(timeout=10)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` on the engine thread between two steps; the future carries its result.

        Once the engine thread is gone the future fails at once with a 503 naming the reason.
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._commands_lock:
            if self.dead_reason is not None:
                fut.set_exception(self._dead_error())
                return fut
            self._commands.put((fn, fut))
        self._wakeup.set()
        return fut

    async def run(self, fn: Callable[[], Any]) -> Any:
        """`call` awaited from the HTTP event loop: `fn`'s result, run on the engine thread."""
        return await asyncio.wrap_future(self.call(fn))

    def add_death_listener(self, listener: Callable[[str], None]) -> None:
        """Call `listener(reason)` (from the dying thread) when the engine thread stops."""
        with self._commands_lock:
            dead = self.dead_reason
            if dead is None:
                self._death_listeners.append(listener)
        if dead is not None:
            listener(dead)

    def _dead_error(self) -> ProtocolError:
        return ProtocolError(f"the engine is not running: {self.dead_reason}", 503)

    def _loop(self) -> None:
        reason = "the engine was shut down"
        try:
            self._serve()
        except BaseException as e:
            logger.exception("the engine thread died")
            reason = f"the engine thread died: {type(e).__name__}: {e}"
        finally:
            self._die(reason)

    def _serve(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop:
            # Clear before draining: a command queued after this point sets the event again,
            # so the wait below cannot sleep through it.
            self._wakeup.clear()
            self._run_commands()
            self.timeline.look(self.paused, self.weights.released, self.scheduler)
            if self.paused or self.weights.released or not self.scheduler.has_work():
                self._book_in_flight()  # a last launched step whose sequences had all finished
                self._wakeup.wait(timeout=1.0)
                continue
            try:
                self._step()
            except Exception as e:  # a bug or OOM: fail the in-flight requests, keep serving
                logger.exception("engine step failed; aborting in-flight requests")
                self._fail_in_flight(f"engine error: {type(e).__name__}: {e}")

    def _book_in_flight(self) -> None:
        """Book the decode round in flight, if any (a failure fails the requests, as a step's)."""
        if self.rounds is None or self.rounds.pending is None:
            return
        try:
            self.rounds.drain()
        except Exception as e:
            logger.exception("engine step failed; aborting in-flight requests")
            self._fail_in_flight(f"engine error: {type(e).__name__}: {e}")

    def _fail_in_flight(self, message: str) -> None:
        """Abort every request and start the runner afresh (its KV state is not trusted)."""
        if self.rounds is not None:
            self.rounds.drop()
        victims = self.scheduler.abort(None, message)
        self.runner.reset()
        self._runner_suspect = False
        self._finish(victims)

    def _die(self, reason: str) -> None:
        """Refuse new commands, fail the queued ones and tell the listeners (HTTP front)."""
        with self._commands_lock:
            self.dead_reason = reason
            listeners, self._death_listeners = self._death_listeners, []
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(self._dead_error())
        for listener in listeners:
            try:
                listener(reason)
            except Exception:
                logger.exception("engine death listener failed")

    def _run_commands(self) -> None:
        while True:
            try:
                fn, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            self._book_in_flight()  # a command sees every launched step booked
            try:
                fut.set_result(fn())
            except BaseException as e:
                fut.set_exception(e)

    def _step(self) -> None:
        if self.rounds is not None and self.rounds.pending is not None and self.scheduler.admits():
            self.rounds.drain()  # admissions see every launched step booked (room, aborts)
        plan = self.scheduler.plan()
        if plan is None:
            return
        self.profiler.before_step(self.num_steps)
        t0 = time.perf_counter()
        try:
            rounds = self.rounds
            if rounds is not None and plan.kind == "decode" and rounds.takes(plan.seqs):
                rounds.step()
                return
            if rounds is not None and rounds.pending is not None:
                rounds.drain()
                if plan.kind == "decode" and not self.runner.active:
                    return  # the booked step finished every sequence
            self._run_plan(plan)
        finally:
            self.busy_seconds += time.perf_counter() - t0
            self.profiler.after_step(self.num_steps)

    def _run_plan(self, plan: Any) -> None:
        started = time.perf_counter()  # a prefill's: when its sequences were admitted
        if plan.kind == "prefill":
            seqs, logits = plan.seqs, self.runner.prefill(plan.seqs)
        else:
            seqs, logits = self.runner.decode()
        gens = [s.runner_state.get("generator") for s in seqs]
        top_n = [s.top_logprobs_num for s in seqs]
        out = sample(logits, [s.params for s in seqs], gens, self.generator, top_n, self.never_sampled)
        if plan.kind == "prefill":  # per request: a first token is always a prefill's
            sampled = time.perf_counter()
            for seq in seqs:
                seq.times.mark_prefill(started, sampled)
        finished = self.scheduler.append_tokens(seqs, out.tokens, out.logprobs, out.top_logprobs)
        self.num_steps += 1
        self.num_generated_tokens += len(seqs)
        self._finish(finished)

    def _finish(self, seqs: list[Sequence]) -> None:
        # Each sequence on its own: one failing release or callback must not leave the others'
        # clients waiting, nor escape into the loop and take the engine thread down.
        now = time.perf_counter()
        for seq in seqs:
            seq.times.finished = now
            if seq in self.runner.active:
                try:
                    self.runner.release(seq)
                except Exception:
                    logger.exception("releasing the KV state of request %s failed", seq.rid)
                    self._runner_suspect = True
            seq.record_versions(self.weight_version)
            seq.weight_version = self.weight_version
            if seq.lora is not None:  # the adapter may be unloaded once no sequence uses it
                seq.lora.users -= 1
                seq.lora = None
            if seq.on_finish is not None:
                try:
                    seq.on_finish(seq)
                except Exception:
                    logger.exception("the finish callback of request %s failed", seq.rid)
        if self._runner_suspect:
            # Reset now, in this turn of the engine thread: a request admitted by the next
            # _run_commands (e.g. the one a client sends as soon as its answer arrived) must not
            # be aborted for a failure that happened before it existed.
            self._fail_in_flight("engine error: KV state was lost and reset")

    @property
    def weight_version(self) -> str:
        """The version of the weights served (SGLang's weight_version)."""
        return self._weight_version

    @weight_version.setter
    def weight_version(self, version: str) -> None:
        """Engine thread only: the tokens made so far are the old version's (each sequence's
        `version_spans` is brought up to date here and when it finishes, not at every step)."""
        for seq in [*self.scheduler.waiting, *self.scheduler.running]:
            seq.record_versions(self._weight_version)
        self._weight_version = version

    def current_load(self) -> EngineLoad:
        """What the engine holds now, read from any thread without a lock (the engine thread is
        never made to wait for a scrape): counts copied between two of its steps' changes, so
        at most one step stale. The KV capacity is the slot cache's bound: a row of
        `context_length` positions for each of `max_running_requests` sequences."""
        active = list(self.runner.active)  # one C-level copy: the engine thread changes the list
        return EngineLoad(
            num_running_reqs=len(self.scheduler.running),
            num_queue_reqs=len(self.scheduler.waiting),
            num_used_tokens=sum(seq.num_cached for seq in active),
            max_total_num_tokens=self.config.max_running_requests * self.context_length,
            num_generated_tokens=self.num_generated_tokens,
        )

    # ---- requests (called from the HTTP side: event loop or worker threads) ------------------
    def check_available(self) -> None:
        if self.weights.released:
            raise ProtocolError(
                "engine memory is released; call /resume_memory_occupation and push weights", 503
            )
        if self.weights.stale:
            raise ProtocolError(
                "engine weights are not loaded: "
                + self.weights.describe_stale()
                + "; push weights before generating",
                503,
            )

    def make_sequence(self, req: GenerateRequest, on_finish: Callable[[Sequence], None]) -> Sequence:
        """Tokenize and validate one request; raise ProtocolError for bad input."""
        images = None
        if req.image_data:
            if self.images is None:
                raise ProtocolError(
                    f"'image_data': model_type {self.model.config.model_type!r} is a text model"
                )
            ids, images = self.images.prepare_request(req)
        elif req.input_ids is not None:
            ids = list(req.input_ids)
        else:
            ids = self.tokens.encode(req.text) if req.text else []
            if not ids:
                raise ProtocolError("'text' tokenizes to no tokens; give a non-empty prompt")
        routed = None
        if req.return_routed_experts and not getattr(self.runner, "routers", None):
            routed = (
                f"model_type {self.model.config.model_type!r} has no routed experts this engine can record"
            )
        check_request(
            req, ids, self.vocab_size, self.context_length, self.config, routed, self.adapters is not None
        )
        if images is None and self.images is not None:
            self.images.check_no_images(ids)
        params = req.sampling_params
        seq = Sequence(
            rid=req.rid,
            prompt_ids=ids,
            params=params,
            return_logprob=req.return_logprob,
            logprob_start_len=req.logprob_start_len if req.return_logprob else -1,
            return_text_in_logprobs=req.return_text_in_logprobs,
            # Top log-probs are only reported with return_logprob: don't compute them otherwise.
            top_logprobs_num=req.top_logprobs_num if req.return_logprob else 0,
            return_routed_experts=req.return_routed_experts,
            on_finish=on_finish,
            lora_name=req.lora_path,
            images=images,
        )
        if params.sampling_seed is not None and not params.greedy:
            seq.runner_state["generator"] = torch.Generator(device=self.device).manual_seed(
                params.sampling_seed
            )
        return seq

    def add(self, seqs: list[Sequence]) -> concurrent.futures.Future:
        def _add() -> None:
            self.check_available()
            # As SGLang does: a rid names one in-flight request, so aborting by rid is unambiguous.
            taken = sorted({s.rid for s in seqs if self.scheduler.is_in_flight(s.rid)})
            if taken:
                raise ProtocolError(
                    f"'rid' {taken[:5]} already names a request in flight; give each request its own rid"
                )
            named = [s for s in seqs if s.lora_name is not None]
            if named:  # every adapter first: a request naming one that is not loaded fails alone
                assert self.adapters is not None  # make_sequence checked
                adapters = [self.adapters.resolve(str(s.lora_name)) for s in named]
                for seq, adapter in zip(named, adapters):
                    seq.lora = adapter
            try:
                self._score_inputs(seqs)
            except BaseException:
                for seq in named:  # never admitted: they hold no adapter
                    seq.lora = None
                raise
            for seq in named:  # counted once admitted: _finish gives each back exactly once
                seq.lora.users += 1
            queued = time.perf_counter()
            for seq in seqs:
                seq.times.queued = queued
                if seq.params.max_new_tokens == 0:
                    self.scheduler.finish_without_decoding(seq)
                    self._finish([seq])
                else:
                    self.scheduler.add(seq)

        return self.call(_add)

    def _score_inputs(self, seqs: list[Sequence]) -> None:
        """The input log-probs of the requests that ask for them (`logprob_start_len`): a
        teacher-forced forward of the inputs (slime's OPD teacher asks this)."""
        scored = [s for s in seqs if s.logprob_start_len >= 0]
        if not scored:
            return
        t0 = time.perf_counter()
        try:
            for seq, values in zip(
                scored,
                input_log_probs(
                    self.model,
                    [s.prompt_ids for s in scored],
                    [s.logprob_start_len for s in scored],
                    [s.params.temperature for s in scored],
                    self.config.max_prefill_tokens,
                    self.config.deterministic,
                    self.adapters,
                    [s.lora for s in scored],
                ),
            ):
                seq.input_logprobs = values
        finally:
            self.busy_seconds += time.perf_counter() - t0

    def abort(self, rid: str | None, message: str = "aborted by request") -> concurrent.futures.Future:
        """Abort the request named `rid` (None: all); the future carries how many were aborted."""
        return self.call(lambda: self.abort_now(rid, message))

    def abort_sequences(self, seqs: list[Sequence], message: str) -> concurrent.futures.Future:
        """Abort exactly these sequences (by identity), if they are still in flight."""

        def _abort() -> int:
            victims = self.scheduler.abort_sequences(seqs, message)
            self._finish(victims)
            return len(victims)

        return self.call(_abort)

    def abort_now(self, rid: str | None, message: str) -> int:
        """Engine thread only: abort by rid (None: all) and deliver the partial results."""
        victims = self.scheduler.abort(rid, message)
        self._finish(victims)
        return len(victims)

    def retract_all(self) -> int:
        """Engine thread only (SGLang's `retract` pause): every running sequence gives its KV
        state up and waits again, ahead of the others; its next prefill feeds the prompt and the
        tokens generated so far with the weights current then, and samples its next token from
        that prefill's last position. Returns how many were retracted."""
        retracted = list(self.scheduler.running)
        for seq in retracted:
            if seq in self.runner.active:
                self.runner.release(seq)
            seq.num_cached = 0
        self.scheduler.retract(retracted)
        return len(retracted)
