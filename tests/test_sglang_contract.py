"""What slime sends to an SGLang server and how it reads the answers, checked against SGLang.

- tests/fixtures/sglang/request_fields.json: the field names of SGLang 0.5.23's request types
  per route (extracted from its source by extract_fields.py beside it) and the sampling-param keys
  its /generate contract accepts (unknown ones are refused with 400 there).
- tests/fixtures/sglang/responses.json: SGLang 0.5.23's answers per route, written down from its
  HTTP server's source (SGLang cannot run here, so none was captured from a live server).

A loopback replay server answers with those responses, records every request, and enforces
SGLang 0.5.23's weight-update session rule. slime's real code (the engine client, the default
generate function, the weight bridge with its transports, the health monitor's probe) talks to it.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest
import torch
from aiohttp import web

from slime.bridge.adapter import push_adapter
from slime.bridge.bridge import WeightBridge
from slime.bridge.disk import DiskTransport
from slime.bridge.tensor import TensorTransport
from slime.config.rollout import SamplingConfig
from slime.engines.client import EngineClient, EngineError
from slime.rollout.default_generate import apply_response, generate
from slime.utils.sample import Sample, Status
from slime.utils.seed import sample_seed

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "sglang")
with open(os.path.join(HERE, "request_fields.json")) as f:
    FIELDS = json.load(f)
with open(os.path.join(HERE, "responses.json")) as f:
    RESPONSES = json.load(f)
SESSION_ROUTES = ("/update_weights_from_tensor", "/update_weights_from_distributed")


class ReplayServer:
    """Answers as SGLang 0.5.23 does (the fixtures); `cases` picks a non-"ok" answer per route,
    `sessions=False` plays an SGLang without weight-update sessions (404 on begin/end)."""

    def __init__(self, cases: dict[str, str] | None = None, sessions: bool = True):
        self.cases = dict(cases or {})
        self.sessions = sessions
        self.session_open = False
        self.calls: list[tuple[str, str, Any]] = []
        self.loras: set[str] = set()
        """Adapters loaded: SGLang refuses a taken name and unloading one that is not loaded."""

    async def handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        body = json.loads(raw) if raw else None
        path = request.path
        self.calls.append((request.method, path, body))
        case = self.cases.get(path) or next(
            iter(RESPONSES.get(path, {"": None}))
        )  # first case: the usual answer
        if path in ("/begin_weight_update", "/end_weight_update") and not self.sessions:
            return web.json_response({"detail": "Not Found"}, status=404)
        if path == "/begin_weight_update":
            case = "already_open" if self.session_open else case
            self.session_open = True
        elif path == "/end_weight_update":
            self.session_open = False
        elif path in SESSION_ROUTES and self.sessions and not self.session_open:
            case = "no_session"
        elif path in ("/load_lora_adapter", "/load_lora_adapter_from_tensors"):
            case = "exists" if body["lora_name"] in self.loras else case
            self.loras.add(body["lora_name"])
        elif path == "/unload_lora_adapter":
            case = "not_loaded" if body["lora_name"] not in self.loras else case
            self.loras.discard(body["lora_name"])
        if path not in RESPONSES:
            return web.json_response({"detail": "Not Found"}, status=404)
        answer = RESPONSES[path][case]
        kind = answer["content_type"]
        if kind == "json":
            return web.Response(
                status=answer["status"], body=json.dumps(answer["body"]), content_type="application/json"
            )
        if kind == "none":
            return web.Response(status=answer["status"])
        resp = web.Response(status=answer["status"], body=answer["body"].encode())
        resp.headers.pop("Content-Type", None)  # starlette's Response(content=...) sets none
        return resp

    async def __aenter__(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


def check_against_sglang(calls: list[tuple[str, str, Any]]) -> set[str]:
    """Every request body uses SGLang's field names (required ones present); returns the routes seen."""
    seen = set()
    for method, path, body in calls:
        seen.add(path)
        if path == "/abort_request":
            assert set(body) <= set(FIELDS["abort_request"]), body
            continue
        if path not in FIELDS["endpoints"]:
            assert method == "GET" or path == "/flush_cache", (
                f"{method} {path} is not an SGLang request route"
            )
            continue
        fields = FIELDS["endpoints"][path]
        assert isinstance(body, dict), (
            f"{path}: SGLang needs a JSON object body (at least {{}}), got {body!r}"
        )
        unknown = set(body) - set(fields)
        assert not unknown, f"{path}: {sorted(unknown)} are not fields of SGLang's request"
        missing = {k for k, required in fields.items() if required} - set(body)
        assert not missing, f"{path}: SGLang requires {sorted(missing)}"
        if path.startswith("/update_weights_from_"):
            # SGLang flushes the cache after an update by default and fails it while paused requests
            # hold KV cache: every update must say flush_cache false.
            assert body.get("flush_cache") is False, f"{path} must send flush_cache: false"
        if path == "/generate":
            extra = set(body.get("sampling_params", {})) - set(FIELDS["sampling_params"])
            assert not extra, f"sampling_params {sorted(extra)} would be refused with 400 by SGLang"
    return seen


def test_the_fixtures_are_sglangs():
    assert FIELDS["sglang_version"] == "0.5.23"
    # Spot checks against SGLang's io_struct, so that an edited fixture cannot pass silently.
    init = FIELDS["endpoints"]["/init_weights_update_group"]
    assert {k for k, req in init.items() if req} == {
        "master_address",
        "master_port",
        "rank_offset",
        "world_size",
    }
    assert FIELDS["endpoints"]["/update_weights_from_tensor"]["serialized_named_tensors"] is True
    assert "sampling_seed" in FIELDS["sampling_params"] and "seed" not in FIELDS["sampling_params"]


def test_every_request_slime_sends_uses_sglang_field_names(tmp_path, tiny_model):
    async def scenario() -> set[str]:
        server = ReplayServer()
        async with server as url, EngineClient(url) as c:
            # The rollout's requests: default generate with every sampling flag, deterministic seed.
            sampling = SamplingConfig(4, 0.7, 0.9, 20, 3, ("\n",), (151645,)).params()
            sampling["sampling_seed"] = sample_seed(1234, "rollout", 0, 0, 0)
            await generate(c, Sample(prompt="p"), [1, 2, 3, 4], sampling)
            # A vision-language prompt: the ids with the image's tokens and SGLang's image_data.
            await generate(
                c, Sample(prompt="p"), [1, 2, 3, 4], sampling, image_data=["data:image/png;base64,AA=="]
            )
            await c.health_generate()
            await c.abort_request(rid="x")
            await c.abort_request(abort_all=True)
            # Colocation, checks and the distributed transport's group calls.
            await c.release_memory_occupation()
            await c.resume_memory_occupation(["weights"])
            await c.resume_memory_occupation(["kv_cache", "cuda_graph"])
            await c.weights_checker("snapshot")
            await c.init_weights_update_group("10.0.0.1", 29500, 1, 2, "slime", "nccl")
            await c.begin_weight_update()
            await c.update_weights_from_distributed(
                ["a.weight"], ["bfloat16"], [[2, 3]], "slime", weight_version="1"
            )
            await c.end_weight_update()
            await c.destroy_weights_update_group("slime")
            await c.get_weight_version()
            await c.get_server_info()
            await c.update_weight_version("3")
        # Whole pushes through the bridge: tensor (a session around it) and disk.
        named = [("model.norm.weight", torch.ones(8)), ("lm_head.weight", torch.zeros(4, 8))]
        for transport in (TensorTransport(), DiskTransport(tiny_model, root=str(tmp_path))):
            async with server as url:
                bridge = WeightBridge(transport, [url])
                await bridge.push([named], "2")
                await bridge.close()
        return check_against_sglang(server.calls)

    seen = asyncio.run(scenario())
    assert {
        "/generate",
        "/update_weights_from_tensor",
        "/update_weights_from_disk",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/pause_generation",
        "/continue_generation",
        "/begin_weight_update",
        "/end_weight_update",
    } <= seen


def test_the_adapter_push_to_sglang_replaces_the_adapter_with_sglangs_routes_and_fields():
    """Upstream SGLang has no in-place replacement: each push unloads the adapter (a 400 the first
    time, none loaded) and loads the new one from a flattened_bucket payload per TP rank, with
    the checksums SGLang checks; the version is set without aborting the paused requests."""
    from slime.utils.checksum import bytes_sha256
    from slime.utils.flattened_bucket import deserialize

    names = [
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
        "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
    ]
    named = [(names[0], torch.arange(16.0).reshape(2, 8)), (names[1], torch.ones(8, 2))]
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"]}

    async def scenario() -> list[ReplayServer]:
        servers = [ReplayServer(), ReplayServer()]
        async with servers[0] as url, servers[1] as url2:
            bridge = WeightBridge(TensorTransport(), [url, url2], tp_sizes=[1, 2], sglang=True)
            payloads = []
            for version, checks in (("1", True), ("2", False)):
                stats = await push_adapter(bridge, named, config, version, checksums=checks)
                assert stats["bytes"] == 16 * 4 + 16 * 4
                load = [b for _, p, b in servers[1].calls if p == "/load_lora_adapter_from_tensors"][-1]
                payloads.append(deserialize(load["serialized_named_tensors"][-1]))  # while the buffer is live
            await bridge.close()
        assert [[(n, t.tolist()) for n, t in p] for p in payloads] == [
            [(n, t.tolist()) for n, t in named]
        ] * 2
        return servers

    for tp, server in zip((1, 2), asyncio.run(scenario())):
        check_against_sglang(server.calls)
        one_push = [
            "/pause_generation",
            "/unload_lora_adapter",
            "/load_lora_adapter_from_tensors",
            "/update_weight_version",
            "/continue_generation",
        ]
        assert [p for _, p, _ in server.calls] == one_push * 2
        assert server.loras == {"slime_lora"}
        loads = [b for _, p, b in server.calls if p == "/load_lora_adapter_from_tensors"]
        assert [len(b["serialized_named_tensors"]) for b in loads] == [tp, tp]  # one per TP rank
        assert all(b["lora_name"] == "slime_lora" and b["load_format"] == "flattened_bucket" for b in loads)
        assert loads[0]["expected_checksums"] == {n: bytes_sha256(t) for n, t in named}
        assert "expected_checksums" not in loads[1]
        versions = [b for _, p, b in server.calls if p == "/update_weight_version"]
        assert versions == [{"new_version": v, "abort_all_requests": False} for v in ("1", "2")]


@pytest.mark.parametrize("sessions", [True, False])
def test_a_push_runs_inside_sglangs_weight_update_session(sessions):
    async def scenario() -> list[str]:
        server = ReplayServer(sessions=sessions)
        async with server as url:
            bridge = WeightBridge(TensorTransport(), [url])
            buckets = [[("a", torch.ones(4))], [("b", torch.ones(2))]]
            await bridge.push(buckets, "3")
            await bridge.close()
        return [p for _, p, _ in server.calls]

    paths = asyncio.run(scenario())
    updates = ["/update_weights_from_tensor"] * 2
    if sessions:  # SGLang 0.5.23 refuses these updates outside a session
        assert paths == [
            "/pause_generation",
            "/flush_cache",
            "/begin_weight_update",
            *updates,
            "/end_weight_update",
            "/continue_generation",
        ]
    else:  # older SGLang: no session routes (404), the updates go straight in
        assert paths == [
            "/pause_generation",
            "/flush_cache",
            "/begin_weight_update",
            *updates,
            "/continue_generation",
        ]


def test_a_failed_update_ends_the_session_and_resumes_generation():
    async def scenario() -> tuple[list[str], str]:
        server = ReplayServer(cases={"/update_weights_from_tensor": "no_session"})
        async with server as url:
            bridge = WeightBridge(TensorTransport(), [url])
            with pytest.raises(EngineError) as e:
                await bridge.push([[("a", torch.ones(4))]], "3")
            await bridge.close()
        return [p for _, p, _ in server.calls], e.value.message

    paths, message = asyncio.run(scenario())
    assert paths[-2:] == ["/end_weight_update", "/continue_generation"]
    assert (
        message == "HTTP 400: update_weights_from_tensor must run between begin_weight_update() and "
        "end_weight_update()"
    )


@pytest.mark.parametrize(
    "case, status, tokens, log_probs",
    [
        ("length", Status.TRUNCATED, [1, 2, 3, 4, 17, 18, 19], [-0.5, -0.125, -1.0]),
        ("stop", Status.COMPLETED, [1, 2, 3, 4, 17, 151645], [-0.5, -0.0625]),
        ("abort", Status.ABORTED, [1, 2, 3, 4], []),
    ],
)
def test_sglang_generate_answers_become_samples(case, status, tokens, log_probs):
    sample = apply_response(Sample(prompt="p"), [1, 2, 3, 4], RESPONSES["/generate"][case]["body"])
    assert sample.status == status and sample.tokens == tokens and sample.rollout_log_probs == log_probs
    assert sample.response_length == len(log_probs) and sample.loss_mask == [1] * len(log_probs)
    assert sample.weight_versions == ["7"]


def test_sglang_answers_are_read_as_slime_expects():
    async def scenario() -> None:
        async with ReplayServer() as url, EngineClient(url) as c:
            assert await c.get_weight_version() == "7"  # /get_weight_version is gone: /model_info's
            assert await c.release_memory_occupation() is None  # 200 with a JSON null
            assert (await c.flush_cache()).startswith("Cache flushed.")  # plain text
            assert await c.health_generate() is True  # 200, empty body
            assert (await WeightBridge(TensorTransport(), [url]).engine_dtype()) is None  # dtype "auto"
        cases = {
            "/update_weights_from_disk": "failed",
            "/release_memory_occupation": "busy",
            "/health_generate": "stuck",
            "/generate": "unknown_sampling_field",
            "/weights_checker": "differs",
        }
        async with ReplayServer(cases) as url, EngineClient(url) as c:
            with pytest.raises(EngineError) as e:
                await c.update_weights_from_disk("/nowhere")
            assert e.value.status == 400 and e.value.message.endswith("(repository not found).")
            with pytest.raises(EngineError) as e:
                await c.release_memory_occupation()
            assert e.value.message == "HTTP 400: release_memory_occupation requires an idle scheduler"
            with pytest.raises(EngineError) as e:
                await c.generate([1], sampling_params={"bogus": 1})
            assert "unknown field `bogus`" in e.value.message
            with pytest.raises(EngineError) as e:
                await c.weights_checker("compare")
            assert e.value.message == "HTTP 400: name=model.norm.weight max_abs_err=0.5 mean_abs_err=0.01"
            assert await c.health_generate() is False  # 503

    asyncio.run(scenario())


def test_an_engine_that_expands_images_its_own_way_is_caught():
    """SGLang answers prompt_tokens 4: a request with images that sent 5 ids ran another prompt
    than the trainer will see."""

    async def scenario() -> None:
        async with ReplayServer() as url, EngineClient(url) as c:
            sample = Sample(prompt="p", index=7)
            with pytest.raises(
                ValueError, match=r"sample 7: the engine at .* ran 4 prompt tokens for the 5 sent"
            ):
                await generate(c, sample, [1, 2, 3, 4, 5], {"max_new_tokens": 3}, image_data=["data:,"])
            await generate(c, Sample(prompt="p"), [1, 2, 3, 4, 5], {"max_new_tokens": 3})  # text: not checked

    asyncio.run(scenario())


def test_an_adapter_on_experts_is_not_pushed_to_sglang():
    """An adapter of PEFT's fused experts or router (target_parameters), a layout not checked
    against SGLang: the adapter push refuses it by name before anything is copied or any engine
    asked (the merged push serves it)."""
    import pytest

    from slime.bridge.bridge import WeightBridge
    from slime.bridge.tensor import TensorTransport
    from slime.utils.async_utils import run_sync
    from slime.utils.errors import UsageError

    named = [("base_model.model.model.layers.0.mlp.experts.lora_A.weight", torch.ones(8, 4))]
    config = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_parameters": ["down_proj"]}
    bridge = WeightBridge(TensorTransport(), ["http://127.0.0.1:9"], sglang=True)
    try:
        with pytest.raises(
            UsageError,
            match=r"adapts parameters \(down_proj: .*not checked SGLang serves; use --lora-push merged",
        ):
            run_sync(push_adapter(bridge, named, config, "1"))
    finally:
        run_sync(bridge.close())
