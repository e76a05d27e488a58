"""LoRA routes of the torch engine, SGLang's names and answers: /load_lora_adapter,
/load_lora_adapter_from_tensors, /unload_lora_adapter (the adapters themselves:
slime.engines.torch_engine.lora). Every answer is SGLang's {success, error_message,
loaded_adapters}, HTTP 400 when the change failed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from aiohttp import web

from slime.engines.protocol import ProtocolError
from slime.engines.torch_engine.engine import TorchEngine
from slime.engines.torch_engine.http_util import json_object, read_json
from slime.engines.torch_engine.lora import ServedAdapters, read_dir


class LoRAAPI:
    def __init__(self, engine: TorchEngine):
        self.engine = engine

    def register(self, router: web.UrlDispatcher) -> None:
        router.add_post("/load_lora_adapter", self.load_lora_adapter)
        router.add_post("/load_lora_adapter_from_tensors", self.load_lora_adapter_from_tensors)
        router.add_post("/unload_lora_adapter", self.unload_lora_adapter)

    async def _answer(self, error: str | None = None) -> web.Response:
        """SGLang's answer: {success, error_message, loaded_adapters}, 400 with an error."""
        adapters = self.engine.adapters
        if adapters is None:
            error = "LoRA is not enabled: start the engine with --enable-lora"
        loaded = {} if adapters is None else await self.engine.run(adapters.loaded)
        return web.json_response(
            {"success": error is None, "error_message": error, "loaded_adapters": loaded},
            status=400 if error else 200,
        )

    async def _lora(self, change: Callable[[ServedAdapters], Any]) -> web.Response:
        """Run `change` on the engine thread; SGLang's answer."""
        adapters = self.engine.adapters
        if adapters is None:
            return await self._answer()
        try:
            await self.engine.run(lambda: change(adapters))
        except ProtocolError as e:
            if e.status == 503:  # the engine stopped: not the adapter's fault
                raise
            return await self._answer(e.message)
        return await self._answer()

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        body = json_object(await read_json(request))
        name, path = _lora_name(body), body.get("lora_path")
        if not isinstance(path, str) or not path:
            raise ProtocolError("'lora_path' must be the path of a PEFT adapter directory")
        checked = await self._lora(lambda adapters: adapters.check_new(name))  # a taken name, before reading
        if checked.status != 200:
            return checked
        # The files are read off the engine thread (generation goes on meanwhile).
        try:
            config, tensors = await asyncio.to_thread(read_dir, name, path)
        except ProtocolError as e:
            return await self._answer(e.message)
        return await self._lora(lambda adapters: adapters.load(name, config, tensors, path))

    async def load_lora_adapter_from_tensors(self, request: web.Request) -> web.Response:
        """The adapter's tensors by shared-memory handle: `serialized_named_tensors` (a list with
        one handle, SGLang's current field) or `serialized_tensors` (one handle, its older one),
        with the PEFT `config_dict`."""
        body = json_object(await read_json(request))
        name, config = _lora_name(body), body.get("config_dict")
        if not isinstance(config, dict):
            raise ProtocolError(
                "'config_dict' must be the adapter's PEFT config (r, lora_alpha, target_modules)"
            )
        serialized = body.get("serialized_named_tensors")
        if serialized is None and isinstance(body.get("serialized_tensors"), str):
            serialized = [body["serialized_tensors"]]
        store = self.engine.weights

        upsert = body.get("upsert", False)
        if not isinstance(upsert, bool):
            raise ProtocolError("'upsert' must be true or false")

        expected = body.get("expected_checksums")
        if expected is not None and not (
            isinstance(expected, dict) and all(isinstance(v, str) for v in expected.values())
        ):
            raise ProtocolError("'expected_checksums' must map tensor names to sha256 hex digests")

        def load(adapters: ServedAdapters) -> None:
            tensors = dict(store.open_tensors(serialized, body.get("load_format")))
            if expected is not None:
                check_received(tensors, expected)
            adapters.load(name, config, tensors, "__tensor__", upsert)  # SGLang's path for tensors

        return await self._lora(load)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        """Waits (as SGLang) until no request in flight uses the adapter."""
        name = _lora_name(json_object(await read_json(request)))
        adapters = self.engine.adapters
        started = await self._lora(lambda a: a.start_unload(name))  # no new request takes it
        if adapters is None or started.status != 200:
            return started
        while not await self.engine.run(lambda: adapters.unload(name)):
            await asyncio.sleep(0.01)
        return await self._answer()


def check_received(tensors: dict[str, Any], expected: dict[str, str]) -> None:
    """SGLang's `expected_checksums`: the sha256 of each received tensor's bytes must be the
    sender's, and the names the same; worded as SGLang words it ("adapter sync MISMATCH")."""
    from slime.utils.checksum import bytes_sha256

    differ = sorted(n for n, want in expected.items() if n in tensors and bytes_sha256(tensors[n]) != want)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if differ or missing or extra:
        raise ProtocolError(
            f"adapter sync MISMATCH of {len(expected)} expected tensors: {len(differ)} differ {differ[:5]}, "
            f"{len(missing)} missing {missing[:5]}, {len(extra)} extra {extra[:5]}",
            400,
        )


def _lora_name(body: dict[str, Any]) -> str:
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        raise ProtocolError("'lora_name' must be a non-empty string")
    return name
