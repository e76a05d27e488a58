"""The torch engine's weight routes, SGLang's: updates from disk, from tensors and from a
distributed group (the group's set-up and tear-down), the weight_version, and releasing /
resuming memory for a colocated trainer. Each applies on the engine thread, between steps."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from slime.engines.protocol import ProtocolError, parse_tensor_specs
from slime.engines.torch_engine.http_util import json_object, optional_str, read_json
from slime.utils.device_memory import release_device_memory

logger = logging.getLogger("slime.engines.torch_engine.server")  # the routes log as they did in server.py

_MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")  # SGLang's tags


class WeightsAPI:
    def __init__(self, engine: Any):
        self.engine = engine

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        router.add_post("/update_weights_from_tensor", self.update_weights_from_tensor)
        router.add_post("/init_weights_update_group", self.init_weights_update_group)
        router.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
        router.add_post("/update_weights_from_distributed", self.update_weights_from_distributed)
        router.add_post("/release_memory_occupation", self.release_memory_occupation)
        router.add_post("/update_weight_version", self.update_weight_version)
        router.add_post("/resume_memory_occupation", self.resume_memory_occupation)

    async def _update(
        self, request: web.Request, body: dict[str, Any], apply: Callable[[], int]
    ) -> web.Response:
        version = body.get("weight_version")
        if version is not None and (isinstance(version, bool) or not isinstance(version, (str, int))):
            raise ProtocolError("'weight_version' must be a string")

        # slime extension: fingerprints of the parameters this update wrote, in the answer
        # (--check-weight-sync without a second request), and every parameter name.
        fingerprints = bool(body.get("slime_fingerprints"))
        store = self.engine.weights

        def _run() -> tuple[int, str, dict[str, Any] | None]:
            store.applied_fingerprints = {} if fingerprints else None
            try:
                count = apply()
                prints = store.applied_fingerprints
            finally:
                store.applied_fingerprints = None
            # As SGLang: the version changes only when the update names one.
            if version is not None:
                self.engine.weight_version = str(version)
            return count, self.engine.weight_version, prints

        start = time.perf_counter()
        try:
            count, new_version, prints = await self.engine.run(_run)
        except ProtocolError as e:
            return web.json_response({"success": False, "message": e.message}, status=e.status)
        logger.info(
            "%s: %d tensors in %.3f s, weight_version=%s",
            request.path,
            count,
            time.perf_counter() - start,
            new_version,
        )
        return web.json_response(
            {
                "success": True,
                "message": f"updated {count} tensors",
                "weight_version": new_version,
                "num_paused_requests": 0,
                **(
                    {"slime_fingerprints": prints, "slime_parameter_names": store.canonical_names()}
                    if prints is not None
                    else {}
                ),
            }
        )

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = json_object(await read_json(request))
        return await self._update(
            request, body, lambda: self.engine.weights.update_from_disk(body.get("model_path", ""))
        )

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = json_object(await read_json(request))
        return await self._update(
            request,
            body,
            lambda: self.engine.weights.update_from_tensor(
                body.get("serialized_named_tensors"), body.get("load_format")
            ),
        )

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        body = json_object(await read_json(request))
        specs = parse_tensor_specs(body)
        group = optional_str(body, "group_name", "weight_update_group")
        return await self._update(
            request,
            body,
            lambda: self.engine.weights.update_from_distributed(specs, group, self.engine.device),
        )

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        body = json_object(await read_json(request))
        # Rendezvous blocks until the trainer joins: keep it off both the event loop and the engine thread.
        try:
            await asyncio.to_thread(self.engine.weights.init_group, body, self.engine.device)
        except ProtocolError as e:
            return web.json_response({"success": False, "message": e.message}, status=e.status)
        return web.json_response({"success": True, "message": "weight-update group initialised"})

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        body = json_object(await read_json(request, required=False))
        name = optional_str(body, "group_name", "weight_update_group")
        await self.engine.run(lambda: self.engine.weights.destroy_group(name))
        return web.json_response({"success": True, "message": f"group {name!r} destroyed"})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        """SGLang's route: the weight_version reported from now on (an adapter push sets it).
        As in SGLang, every request is aborted first unless `abort_all_requests` is false."""
        body = json_object(await read_json(request))
        version = body.get("new_version")
        if isinstance(version, bool) or not isinstance(version, (str, int)):
            raise ProtocolError("'new_version' must be a string")
        abort = body.get("abort_all_requests", True)
        if not isinstance(abort, bool):
            raise ProtocolError("'abort_all_requests' must be true or false")
        if abort:
            await asyncio.wrap_future(self.engine.abort(None))

        def _set() -> None:
            self.engine.weight_version = str(version)

        await self.engine.run(_set)
        return web.json_response({"success": True, "message": f"weight_version {version}"})

    async def release_memory_occupation(self, request: web.Request) -> web.Response:
        tags = _tags(json_object(await read_json(request, required=False)))

        def _release() -> None:
            if self.engine.scheduler.has_work():
                raise ProtocolError(
                    f"{self.engine.scheduler.num_in_flight} request(s) in flight; abort them or "
                    "let them finish before releasing memory",
                    409,
                )
            if "kv_cache" in tags:
                self.engine.runner.free_cache()
            if "weights" in tags or "cuda_graph" in tags:
                self.engine.runner.forget_graphs()  # they hold the parameters' addresses
            if "weights" in tags:
                self.engine.weights.release()
            release_device_memory()  # back to the driver, for the colocated trainer

        await self.engine.run(_release)
        logger.info("memory released %s", list(tags))
        return web.json_response({"success": True, "message": f"released {list(tags)}"})

    async def resume_memory_occupation(self, request: web.Request) -> web.Response:
        tags = _tags(json_object(await read_json(request, required=False)))

        def _resume() -> None:
            if "weights" in tags:
                self.engine.weights.resume()

        await self.engine.run(_resume)
        logger.info("memory resumed %s", list(tags))
        return web.json_response({"success": True, "message": f"resumed {list(tags)}"})


def _tags(body: dict[str, Any]) -> tuple[str, ...]:
    tags = body.get("tags")
    if tags is None:
        return _MEMORY_TAGS
    if not isinstance(tags, list) or any(t not in _MEMORY_TAGS for t in tags):
        raise ProtocolError(f"'tags' must be a list drawn from {list(_MEMORY_TAGS)}")
    return tuple(tags)
