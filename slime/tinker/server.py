"""The Tinker service's HTTP surface, as the official `tinker` SDK (0.38) calls it: JSON under
`/api/v1/`, protobuf for forward_backward requests and for forward / forward_backward / sample
results, an `X-API-Key` on every request (keys start with `tml-`).

Errors: bad input is a 4xx with a JSON body naming it (the SDK raises BadRequestError and the
like; it retries 5xx, 408, 409 and 429 for minutes, and treats a 400 without a body as a network
glitch, so neither is used for a user's error); work that fails later fails its future, with
category "user" for bad input. A route this server does not build answers 400 naming it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from slime.tinker import rest
from slime.tinker.errors import TinkerUserError
from slime.tinker.service import Service

logger = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
API = "/api/v1"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"detail": message, "error": message}, status=status)


REPLAYED = frozenset(
    API + p
    for p in (
        "/create_session",
        "/create_model",
        "/forward",
        "/forward_backward",
        "/optim_step",
        "/save_weights",
        "/save_weights_for_sampler",
        "/load_weights",
        "/create_sampling_session",
        "/asample",
    )
)
"""The requests that start work or change state: a retry with the same X-Idempotency-Key gets the
answer its first try got (Replies) instead of doing it twice (a second seq_id refused)."""


class Replies:
    """The answers of the REPLAYED requests, by (API key, X-Idempotency-Key): the SDK sends the
    same key with every retry of one call. The last `size` are kept."""

    def __init__(self, size: int = 4096):
        self.size = size
        self._answers: collections.OrderedDict[tuple[str, str], asyncio.Future[tuple[int, bytes, str]]] = (
            collections.OrderedDict()
        )

    async def answer(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        idempotency = request.headers.get("X-Idempotency-Key")
        if request.method != "POST" or request.path not in REPLAYED or not idempotency:
            return await handler(request)
        key = (request.headers.get("X-API-Key", ""), idempotency)
        first = self._answers.get(key)
        if first is not None:  # a retry: the first try's answer, once it has one
            try:
                status, body, content_type = await asyncio.shield(first)
            except asyncio.CancelledError:
                if not first.cancelled():  # (this request itself was cancelled)
                    raise
                return await handler(request)  # the first try kept no answer: this one does the work
            return web.Response(status=status, body=body, content_type=content_type)
        pending: asyncio.Future[tuple[int, bytes, str]] = asyncio.get_running_loop().create_future()
        self._answers[key] = pending
        while len(self._answers) > self.size:
            self._answers.popitem(last=False)
        response: web.StreamResponse | None = None
        try:
            response = await handler(request)
            return response
        finally:
            kept = response.body if isinstance(response, web.Response) else None
            if isinstance(kept, bytes | bytearray) and response is not None:
                pending.set_result((response.status, bytes(kept), response.content_type))
            else:  # (no answer to keep: a retry does the work)
                pending.cancel()
                self._answers.pop(key, None)


def make_app(service: Service, api_keys: tuple[str, ...] = ()) -> web.Application:
    """The aiohttp application; `api_keys`: the keys accepted (none given: any `tml-` key)."""
    replies = Replies()

    @web.middleware
    async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
        key = request.headers.get("X-API-Key", "")
        if not key.startswith("tml-") or (api_keys and key not in api_keys):
            return _error(
                401, "invalid API key: give one of this server's keys (--api-key), which start with tml-"
            )
        return await replies.answer(request, handler)

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except TinkerUserError as e:
            return _error(e.status, str(e))
        except web.HTTPException:
            raise
        except Exception as e:  # a bug: still a 4xx, so the SDK does not retry it for minutes
            logger.exception("tinker request %s failed", request.path)
            return _error(400, f"the server failed on {request.path}: {type(e).__name__}: {e}")

    app = web.Application(middlewares=[auth, errors], client_max_size=1024**3)
    _json_routes(app, service)
    _work_routes(app, service)

    async def not_built(request: web.Request) -> web.StreamResponse:
        return _error(400, f"{request.method} {request.path} is not built on this server yet")

    app.router.add_route("*", API + "/{tail:.*}", not_built)
    app.cleanup_ctx.append(_reaper(service))
    return app


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        data = json.loads(await request.read() or b"{}")
    except ValueError as e:
        raise TinkerUserError(f"{request.path}: the body is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise TinkerUserError(f"{request.path}: the body must be a JSON object")
    return data


def _json_routes(app: web.Application, service: Service) -> None:
    """The routes that answer at once, JSON in and out."""

    def route(method: str, path: str, fn: Callable[[dict[str, Any]], Any]) -> None:
        async def handle(request: web.Request) -> web.StreamResponse:
            return web.json_response(fn(await _body(request)))

        app.router.add_route(method, API + path, handle)

    route("POST", "/client/config", lambda b: {})
    route("POST", "/client/dynamic_config", lambda b: {})
    route("POST", "/telemetry", lambda b: {"status": "accepted"})
    route("POST", "/create_session", service.create_session)
    route("POST", "/session_heartbeat", service.heartbeat)
    route("POST", "/create_model", service.create_model)
    route("POST", "/get_info", service.get_info)
    route("POST", "/optim_step", service.optim_step)
    route("POST", "/save_weights", service.save_weights)
    route("POST", "/save_weights_for_sampler", lambda b: service.save_weights(b, sampler=True))
    route("POST", "/load_weights", service.load_weights)
    route("POST", "/create_sampling_session", service.create_sampling_session)
    route("POST", "/asample", service.asample)
    route(
        "GET",
        "/get_server_capabilities",
        lambda b: {"supported_models": [{"model_name": n, "trainable": True} for n in service.cfg.bases]},
    )

    async def finish(request: web.Request) -> web.StreamResponse:
        found = service.sessions.get(request.match_info["session_id"])
        if found is None:
            service.session(request.match_info["session_id"])  # (404, named)
        elif found.ended is None:  # (finishing an ended session is no error: ServiceClient.close)
            service.end_session(found)
        return web.json_response({})

    async def sampler(request: web.Request) -> web.StreamResponse:
        return web.json_response(service.get_sampler(request.match_info["sampler_id"]))

    def get(path: str, fn: Callable[[web.Request], Any]) -> None:
        async def handle(request: web.Request) -> web.StreamResponse:
            return web.json_response(fn(request))

        app.router.add_get(API + path, handle)

    get("/training_runs", lambda r: rest.training_runs(service, dict(r.query)))
    get("/training_runs/{run}", lambda r: rest.training_run(service, r.match_info["run"]))
    get("/training_runs/{run}/checkpoints", lambda r: rest.run_checkpoints(service, r.match_info["run"]))
    get("/checkpoints", lambda r: rest.all_checkpoints(service, dict(r.query)))
    route("POST", "/weights_info", lambda b: rest.weights_info(service, b))

    async def delete(request: web.Request) -> web.StreamResponse:
        info = request.match_info
        return web.json_response(rest.delete_checkpoint(service, info["run"], info["checkpoint"]))

    app.router.add_delete(API + "/training_runs/{run}/checkpoints/{checkpoint:.+}", delete)
    app.router.add_post(API + "/sessions/{session_id}/finish", finish)
    app.router.add_get(API + "/samplers/{sampler_id}", sampler)


def _work_routes(app: web.Application, service: Service) -> None:
    """forward_backward (protobuf in) and the futures' results (protobuf or JSON out)."""

    async def forward_backward(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        if request.headers.get("Content-Encoding") == "zstd":
            import zstandard

            raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=1 << 32)
        return web.json_response(service.forward_backward(raw))

    async def retrieve(request: web.Request) -> web.StreamResponse:
        data = await _body(request)
        outcome = await service.futures.wait(data.get("request_id"))
        if outcome is None:
            return web.json_response(
                {"type": "try_again", "request_id": data.get("request_id"), "queue_state": "active"}
            )
        if outcome.error is not None:
            return web.json_response({"error": outcome.error, "category": outcome.category})
        if outcome.proto is not None:
            return web.Response(body=outcome.proto, content_type=PROTOBUF)
        return web.json_response(outcome.json)

    app.router.add_post(API + "/forward_backward", forward_backward)
    app.router.add_post(API + "/retrieve_future", retrieve)


def _reaper(service: Service) -> Callable[[web.Application], AsyncIterator[None]]:
    """The app's life: expired sessions ended every 30 s (their models freed); the training
    thread stopped at the end."""

    async def reaper(app: web.Application) -> AsyncIterator[None]:
        async def loop() -> None:
            while True:
                await asyncio.sleep(min(30.0, service.cfg.session_timeout_s))
                service.expire()

        task = asyncio.get_running_loop().create_task(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        service.executor.shutdown(wait=False, cancel_futures=True)
        await service.samplers.close()
        service.close()

    return reaper
