"""HTTP front of the torch engine: SGLang's endpoints and field names, on aiohttp.

Handlers parse and validate on the event loop, hand work to the engine thread and await it.
Every error is a JSON object `{"object": "error", "message": ..., "type": ..., "code": N}` with a
4xx code for client mistakes (malformed JSON, wrong types, out-of-range values); nothing a client
sends can stop the server. With an API key every route but /health* needs
`Authorization: Bearer <key>` (401 otherwise), as in SGLang; /metrics too. The weight-debugging
routes are in debug_api.py, the LoRA routes in lora_api.py, the weight updates and memory release
in weights_api.py; the metrics /metrics serves in metrics.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

import slime
from slime.engines.protocol import (
    CompletionRequest,
    GenerateRequest,
    ProtocolError,
    parse_generate,
)
from slime.engines.torch_engine.debug_api import WeightsDebugAPI
from slime.engines.torch_engine.engine import TorchEngine
from slime.engines.torch_engine.http_util import (
    bearer_matches,
    error_response,
    is_open_path,
    json_object,
    read_json,
)
from slime.engines.torch_engine.lora_api import LoRAAPI
from slime.engines.torch_engine.openai_api import completion_requests, completion_response
from slime.engines.torch_engine.profile_api import ProfileAPI
from slime.engines.torch_engine.pull_api import PullAPI
from slime.engines.torch_engine.results import result_of
from slime.engines.torch_engine.sequence import Sequence
from slime.engines.torch_engine.weights_api import WeightsAPI
from slime.utils.device_memory import cuda_memory_held
from slime.utils.job_trace import RECORDER
from slime.utils.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

UNTRACED = ("/generate", "/v1/", "/slime/trace_events")
"""Routes that get no span on the job's timeline: requests (the engine's row and counters show
them) and the timeline's own."""


@web.middleware
async def timeline_spans(request: web.Request, handler: Handler) -> web.StreamResponse:
    """--trace-dir: each control call (pause, memory release, a weight update, ...) as a span on
    the engine's timeline, concurrent calls on rows of their own. GETs are not recorded.
    Installed only in an engine that records."""
    unknown = request.match_info.http_exception is not None  # a 404 or 405 is no call
    if request.method == "GET" or request.path.startswith(UNTRACED) or unknown:
        return await handler(request)
    with RECORDER.lane("control") as row, RECORDER.span(request.path.lstrip("/"), row, cat="control"):
        return await handler(request)


def make_app(
    engine: TorchEngine, api_key: str | None = None, debug_dump_dir: str | None = None
) -> web.Application:
    """Build the aiohttp application serving `engine`.

    Args:
        api_key: required on every route but /health* (None or empty: no key).
        debug_dump_dir: the directory /slime/dump_parameters may write under (None: refused).
    """

    @web.middleware
    async def errors_and_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        open_path = is_open_path(request.path)
        if api_key and not open_path and not bearer_matches(request.headers.get("Authorization"), api_key):
            return error_response("missing or wrong API key: send 'Authorization: Bearer <key>'", 401)
        try:
            return await handler(request)
        except ProtocolError as e:
            return error_response(e.message, e.status)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return error_response(f"{e.reason}: {request.method} {request.path}", e.status)
        except Exception as e:
            logger.exception("unhandled error in %s %s", request.method, request.path)
            return error_response(f"internal error: {type(e).__name__}: {e}", 500)

    middlewares = [errors_and_auth, *([timeline_spans] if RECORDER.enabled else [])]
    app = web.Application(middlewares=middlewares, client_max_size=512 * 1024**2)
    api = EngineAPI(engine)
    app.on_startup.append(api.on_startup)
    app.on_cleanup.append(api.on_cleanup)
    WeightsDebugAPI(engine, debug_dump_dir).register(app.router)
    LoRAAPI(engine).register(app.router)
    PullAPI(engine).register(app.router)
    WeightsAPI(engine).register(app.router)
    ProfileAPI(engine).register(app.router)
    r = app.router
    r.add_get("/health", api.health)
    r.add_get("/health_generate", api.health_generate)
    for path in ("/get_model_info", "/model_info"):
        r.add_get(path, api.model_info)
    for path in ("/get_server_info", "/server_info"):
        r.add_get(path, api.server_info)
    r.add_get("/get_weight_version", api.weight_version)
    r.add_get("/metrics", api.metrics)
    r.add_get("/slime/trace_events", api.trace_events)
    r.add_post("/generate", api.generate)
    r.add_post("/pause_generation", api.pause_generation)
    r.add_post("/continue_generation", api.continue_generation)
    r.add_post("/abort_request", api.abort_request)
    r.add_route("*", "/flush_cache", api.flush_cache)
    r.add_post("/v1/completions", api.completions)
    r.add_get("/v1/models", api.models)
    return app


class EngineAPI:
    """The endpoint handlers; each awaits work done on the engine thread."""

    def __init__(self, engine: TorchEngine):
        self.engine = engine
        # Result futures of the requests in flight, failed together if the engine thread dies.
        self._pending: set[asyncio.Future] = set()
        self._sampler: asyncio.Task | None = None

    async def on_startup(self, app: web.Application) -> None:
        loop = asyncio.get_running_loop()

        def on_engine_death(reason: str) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is waiting
                loop.call_soon_threadsafe(self._fail_pending, reason)

        self.engine.add_death_listener(on_engine_death)
        self._sampler = asyncio.create_task(self._sample_throughput())

    async def on_cleanup(self, app: web.Application) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler

    async def _sample_throughput(self) -> None:
        """Once a second, the generated-token total behind `sglang:gen_throughput`."""
        while True:
            await asyncio.sleep(1.0)
            self.engine.metrics.sample_throughput(self.engine.num_generated_tokens)

    def _fail_pending(self, reason: str) -> None:
        for fut in list(self._pending):
            if not fut.done():
                fut.set_exception(ProtocolError(f"the engine is not running: {reason}", 503))

    # ---- generation ---------------------------------------------------------------------------
    async def run_requests(
        self, requests: list[GenerateRequest], observe: bool = True
    ) -> list[dict[str, Any]]:
        """Submit requests, wait for all; abort them if the client goes away. `observe`: book
        them in the request metrics (health checks are not, as in SGLang)."""
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        futures: list[asyncio.Future] = [loop.create_future() for _ in requests]

        def finisher(fut: asyncio.Future) -> Callable[[Sequence], None]:
            def on_finish(seq: Sequence) -> None:  # on the engine thread
                try:
                    result = result_of(self.engine, seq)
                except Exception as e:  # this request fails; it must not hang
                    logger.exception("building the response of request %s failed", seq.rid)
                    loop.call_soon_threadsafe(_fail, fut, e)
                    return
                if observe:  # before the answer goes: a client that has it finds it counted
                    try:
                        self.engine.metrics.observe_finished(seq)
                    except Exception:  # the metrics never fail a request
                        logger.exception("booking request %s in the metrics failed", seq.rid)
                loop.call_soon_threadsafe(_resolve, fut, result)

            return on_finish

        def make_sequences() -> list[Sequence]:
            seqs = [self.engine.make_sequence(r, finisher(f)) for r, f in zip(requests, futures)]
            for seq in seqs:
                seq.times.created = started  # before tokenizing, as SGLang's created_time
            return seqs

        # Tokenizing a long text takes a while: do it in a worker thread, never on the event loop.
        if any(r.text is not None or r.image_data for r in requests):
            seqs = await asyncio.to_thread(make_sequences)
        else:
            seqs = make_sequences()
        self._pending.update(futures)
        try:
            await asyncio.wrap_future(self.engine.add(seqs))
            return list(await asyncio.gather(*futures))
        except asyncio.CancelledError:
            # The client went away, possibly while the add was running: the abort queues behind
            # it. Abort these Sequence objects, not their rids, which may be reused by then.
            self.engine.abort_sequences(seqs, "client disconnected")
            raise
        finally:
            self._pending.difference_update(futures)

    async def generate(self, request: web.Request) -> web.Response:
        requests, is_batch = parse_generate(await read_json(request))
        results = await self.run_requests(requests)
        return web.json_response(results if is_batch else results[0])

    async def health(self, request: web.Request) -> web.Response:
        """200 while the engine thread runs; 503 naming the reason once it has stopped."""
        self._check_alive()
        return web.Response(status=200)

    def _check_alive(self) -> None:
        if self.engine.dead_reason is not None:
            raise ProtocolError(f"the engine is not running: {self.engine.dead_reason}", 503)

    async def health_generate(self, request: web.Request) -> web.Response:
        """A real one-token generation, as SGLang does, with a bounded wait."""
        self._check_alive()
        req = GenerateRequest(
            rid=f"health-{uuid.uuid4().hex}",
            input_ids=(0,),
            text=None,
            sampling_params=SamplingParams(max_new_tokens=1, temperature=0.0),
        )
        try:
            await asyncio.wait_for(self.run_requests([req], observe=False), timeout=20)
        except asyncio.TimeoutError:
            raise ProtocolError("health generation did not finish in 20 s", 503) from None
        return web.Response(status=200)

    # ---- info ---------------------------------------------------------------------------------
    async def model_info(self, request: web.Request) -> web.Response:
        cfg = self.engine.config
        return web.json_response(
            {
                "model_path": cfg.model_path,
                "tokenizer_path": cfg.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": self.engine.weight_version,
                "has_image_understanding": self.engine.images is not None,
                "has_audio_understanding": False,
                "model_type": getattr(self.engine.model.config, "model_type", None),
                "architectures": getattr(self.engine.model.config, "architectures", None),
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        e = self.engine
        cfg = e.config
        return web.json_response(
            {
                "engine": "slime-torch",
                "version": slime.__version__,
                "model_path": cfg.model_path,
                "tokenizer_path": cfg.model_path,
                "device": cfg.device,
                "dtype": cfg.dtype,
                "tp_size": 1,
                "dp_size": 1,
                "context_length": e.context_length,
                "max_running_requests": cfg.max_running_requests,
                "random_seed": cfg.random_seed,
                "enable_deterministic_inference": cfg.deterministic,
                "enable_return_routed_experts": cfg.enable_return_routed_experts,
                "runner": type(e.runner).__name__,
                "weight_version": e.weight_version,
                "internal_states": [
                    {
                        "num_running_reqs": len(e.scheduler.running),
                        "num_waiting_reqs": len(e.scheduler.waiting),
                        "paused": e.paused,
                        "memory_released": e.weights.released,
                        "num_steps": e.num_steps,
                        "num_generated_tokens": e.num_generated_tokens,
                        "busy_seconds": e.busy_seconds,
                        **e.runner.stats(),
                        **cuda_memory_held(e.device),
                    }
                ],
            }
        )

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def metrics(self, request: web.Request) -> web.Response:
        """Prometheus' text format: SGLang's metric names (slime.engines.torch_engine.metrics)."""
        return web.Response(body=self.engine.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def trace_events(self, request: web.Request) -> web.Response:
        """The job's timeline (--trace-dir): this process's events since the last call, each given
        out once (slime.utils.job_trace); none unless it records."""
        if RECORDER.enabled:
            with contextlib.suppress(Exception):  # a dead engine thread: its events so far
                await self.engine.run(self.engine.timeline.cut)
        return web.json_response({"recording": RECORDER.enabled, "events": RECORDER.drain()})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.engine.config.model_path, "object": "model", "owned_by": "slime"}],
            }
        )

    # ---- control ------------------------------------------------------------------------------
    async def pause_generation(self, request: web.Request) -> web.Response:
        body = await read_json(request, required=False)
        mode = body.get("mode", "abort") if isinstance(body, dict) else None  # SGLang's default
        if mode not in ("abort", "in_place", "retract"):
            raise ProtocolError("'mode' must be 'abort', 'in_place' or 'retract'")

        def _pause() -> int:
            self.engine.paused = True
            if mode == "abort":
                return self.engine.abort_now(None, "aborted by pause_generation")
            if mode == "retract":
                self.engine.retract_all()
            return 0

        aborted = await self.engine.run(_pause)
        return web.json_response(
            {"success": True, "message": f"generation paused (mode={mode})", "num_aborted_requests": aborted}
        )

    async def continue_generation(self, request: web.Request) -> web.Response:
        def _continue() -> None:
            self.engine.paused = False

        await self.engine.run(_continue)
        return web.json_response({"success": True, "message": "generation continued"})

    async def abort_request(self, request: web.Request) -> web.Response:
        body = json_object(await read_json(request))
        abort_all = body.get("abort_all")
        abort_all = False if abort_all is None else abort_all
        if not isinstance(abort_all, bool):
            raise ProtocolError("'abort_all' must be true or false")
        rid = body.get("rid")
        if not abort_all and not (isinstance(rid, str) and rid):
            raise ProtocolError("give 'rid' (a request id) or 'abort_all': true")
        count = await asyncio.wrap_future(self.engine.abort(None if abort_all else rid))
        return web.json_response({"success": True, "num_aborted": count})

    async def flush_cache(self, request: web.Request) -> web.Response:
        def _flush() -> bool:
            if self.engine.scheduler.running:  # waiting (and retracted) sequences hold no KV state
                return False
            self.engine.runner.free_cache()
            return True

        if not await self.engine.run(_flush):
            raise ProtocolError(
                "Cache not flushed because there are pending requests; abort or wait for them"
            )
        return web.Response(text="Cache flushed.")

    # ---- OpenAI ------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.Response:
        body = CompletionRequest.from_json(await read_json(request))
        limit = self.engine.config.max_top_logprobs_num
        if body.logprobs is not None and body.logprobs > limit:
            raise ProtocolError(
                f"'logprobs' {body.logprobs} exceeds this server's limit of {limit} (--max-top-logprobs-num)"
            )
        requests = completion_requests(body)
        results = await self.run_requests(requests)
        # Decoding every token takes the tokenizer lock: off the event loop.
        answer = await asyncio.to_thread(completion_response, self.engine, body, results)
        return web.json_response(answer)


def _resolve(fut: asyncio.Future, result: Any) -> None:
    if not fut.done():  # the client may have gone away and cancelled it
        fut.set_result(result)


def _fail(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
