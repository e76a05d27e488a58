"""/pull_weights, SGLang's route for disk weight sync: bring this host's local checkpoint
(`local_checkpoint_dir`) to `target_version` of the versions published under `source_dir`, which
the trainer then has the engine load with /update_weights_from_disk (the format and the apply:
slime.utils.weight_delta). The engine's serving weights do not change here: a version that fails
its checksums is refused (HTTP 400, {"success": false, "message"}) and the previous one keeps
serving. The file work runs in a thread, off the event loop and off the engine's thread."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from slime.engines.protocol import ProtocolError
from slime.engines.torch_engine.http_util import json_object, read_json
from slime.utils import weight_delta


class PullAPI:
    def __init__(self, engine: Any):
        self.engine = engine
        """Its model (`config.model_path`) is version 0: the checkpoint the engine started from."""

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/pull_weights", self.pull_weights)

    async def pull_weights(self, request: web.Request) -> web.Response:
        body = json_object(await read_json(request))
        local, source, target = (
            body.get("local_checkpoint_dir"),
            body.get("source_dir"),
            body.get("target_version"),
        )
        if not isinstance(local, str) or not local or not isinstance(source, str) or not source:
            raise ProtocolError("'local_checkpoint_dir' and 'source_dir' must be directory paths")
        if not isinstance(target, int) or isinstance(target, bool) or target < 0:
            raise ProtocolError("'target_version' must be an integer >= 0")
        try:
            base = self.engine.config.model_path
            done = await asyncio.to_thread(weight_delta.pull_weights, local, source, target, base)
        except (weight_delta.DeltaError, OSError) as e:
            return web.json_response({"success": False, "message": str(e)}, status=400)
        return web.json_response({"success": True, "message": f"at version {target}", **done})
