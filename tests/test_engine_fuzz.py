"""Hostile requests to every route of one torch engine on loopback (a few hundred, seconds):
malformed JSON, non-object bodies, wrong types, huge and negative numbers, path traversal. Each
must be answered with a 4xx (or the documented 503 of released weights), never a 5xx, the engine
must keep serving afterwards, and /slime/dump_parameters must create nothing outside the
directory the engine was started with (--debug-dump-dir)."""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from types import SimpleNamespace
from typing import Any, cast

import aiohttp
import pytest

from slime.engines.protocol import new_api_key
from slime.engines.torch_engine.launcher import start_torch_engine
from slime.engines.torch_engine.server import make_app
from tests.conftest import ENGINE_ARGS

KEY = new_api_key()
AUTH = {"Authorization": f"Bearer {KEY}"}
PARAM = "model.embed_tokens.weight"

# Bodies no route can read.
MALFORMED = [
    b"{",  # truncated
    b"\xff\xfe\x00{not utf-8}",
    b"[" * 100_000,  # deeper than the parser's recursion limit
    b"1" + b"0" * 5000,  # an integer beyond Python's digit limit
    b'{"a": NaN}',
    b"[1, 2]",  # not an object
    b'"just a string"',
]
# Values put into each known field, one at a time.
HOSTILE: list[Any] = [None, True, -1, 2**64, -(2**63) - 1, 1e308, "x" * 5000, [[[]]], {"$": {}}]

# route -> (a base body, its fields to spoil); sampling_params fields are spoiled inside it.
FIELDS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "/generate": (
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
        ["input_ids", "text", "rid", "return_logprob", "top_logprobs_num", "sampling_params"],
    ),
    "/v1/completions": (
        {"prompt": [1, 2], "max_tokens": 1},
        ["prompt", "max_tokens", "temperature", "top_p", "n", "logprobs", "stop", "seed"],
    ),
    "/abort_request": ({"rid": "nobody"}, ["rid", "abort_all"]),
    "/pause_generation": ({"mode": "in_place"}, ["mode"]),
    "/update_weights_from_disk": ({"model_path": "/nonexistent"}, ["model_path", "weight_version"]),
    "/update_weights_from_tensor": (
        {"serialized_named_tensors": ["{}"]},
        ["serialized_named_tensors", "load_format"],
    ),
    "/init_weights_update_group": (
        # master_port 0 is invalid: no spoiled field can make the engine dial out or wait.
        {"master_address": "127.0.0.1", "master_port": 0, "rank_offset": 1, "world_size": 2},
        ["master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "timeout_s"],
    ),
    "/update_weights_from_distributed": (
        {"names": [PARAM], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"},
        ["names", "dtypes", "shapes", "group_name"],
    ),
    "/destroy_weights_update_group": ({"group_name": "nope"}, ["group_name"]),
    "/weights_checker": ({"action": "nothing"}, ["action"]),
    "/slime/weights_checksum": ({"names": [PARAM]}, ["names"]),
    "/slime/dump_parameters": ({"path": "ok"}, ["path"]),
    "/release_memory_occupation": ({"tags": ["bogus"]}, ["tags"]),
    "/resume_memory_occupation": ({"tags": ["bogus"]}, ["tags"]),
}
SAMPLING = [
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "sampling_seed",
]
LAST = ("/release_memory_occupation", "/resume_memory_occupation")  # they leave the weights released


def registered_routes() -> list[tuple[str, str]]:
    """(method, path) of every route the server registers (HEAD: as GET; '*': GET and POST)."""
    app = make_app(cast(Any, SimpleNamespace(weights=None)))
    routes = set()
    for route in app.router.routes():
        path = route.resource.canonical if route.resource is not None else ""
        for method in ("GET", "POST") if route.method == "*" else (route.method,):
            if method != "HEAD":
                routes.add((method, path))
    return sorted(routes, key=lambda r: (r[1] in LAST, r[1], r[0]))


@pytest.fixture(scope="module")
def fuzz_engine(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    dumps, outside = root / "dumps", root / "outside"
    (dumps / "planted").mkdir(parents=True)
    outside.mkdir()
    (dumps / "escape").symlink_to(outside)  # a directory symlink out of the dump directory
    (dumps / "planted" / f"{PARAM}.partial").symlink_to(outside / "victim")  # a file one
    log = root / "engine.log"
    proc = start_torch_engine(tiny_model, ENGINE_ARGS, str(log), api_key=KEY, debug_dump_dir=str(dumps))
    yield SimpleNamespace(proc=proc, url=proc.url, root=root, dumps=dumps, outside=outside, log=log)
    assert proc.stop() in (0, -15)


def traversal_paths(env: SimpleNamespace, stray: str) -> list[Any]:
    return [
        "ok",  # the one valid path: relative to the dump directory
        "/proc/self/mem",
        "/etc",
        stray,
        str(env.outside / "abs"),
        "../outside/rel",
        "escape/x",  # through the symlink
        "ok/../../outside/dotdot",
        str(env.dumps / ".." / "outside" / "abs-dotdot"),
        "planted",  # the file symlink
        "ok/\x00nul",
        "a" * 300,  # a component longer than NAME_MAX
        "/".join(["d"] * 3000),  # longer than PATH_MAX
        "",
    ]


def cases(env: SimpleNamespace, routes: list[tuple[str, str]], stray: str) -> list[tuple[str, str, bytes]]:
    out: list[tuple[str, str, bytes]] = []
    for method, path in routes:
        if method == "GET":
            out += [(method, path, b""), (method, path + "?x=%ff&" + "y" * 2000, b"{")]
            continue
        out += [(method, path, body) for body in MALFORMED]
        base, fields = FIELDS.get(path, ({}, []))
        for name in fields:
            out += [(method, path, json.dumps({**base, name: value}).encode()) for value in HOSTILE]
        if path == "/generate":
            for name in SAMPLING:
                out += [
                    (method, path, json.dumps({**base, "sampling_params": {name: v}}).encode())
                    for v in HOSTILE
                ]
        if path == "/slime/dump_parameters":
            out += [(method, path, json.dumps({"path": p}).encode()) for p in traversal_paths(env, stray)]
        if path == "/update_weights_from_tensor":
            for handle in (
                {"kind": "slime-shm", "path": "/proc/self/mem", "nbytes": 2**64, "tensors": []},
                {"kind": "slime-shm", "path": "/dev/zero", "nbytes": -1, "tensors": []},
                {
                    "kind": "slime-shm",
                    "path": str(env.log),
                    "nbytes": 8,
                    "tensors": [{"name": PARAM, "dtype": "float32", "shape": [-1, 2**40], "offset": -5}],
                },
            ):
                out.append(
                    (method, path, json.dumps({"serialized_named_tensors": [json.dumps(handle)]}).encode())
                )
    return out


async def send(
    session: aiohttp.ClientSession, url: str, method: str, path: str, body: bytes
) -> tuple[int, str]:
    async with session.request(method, url + path, data=body or None) as resp:
        return resp.status, await resp.text()


def listing(root) -> set[str]:
    return {os.path.join(d, n) for d, dirs, files in os.walk(root) for n in dirs + files}


def test_every_route_answers_hostile_requests_without_a_5xx(fuzz_engine, tiny_model):
    env = fuzz_engine
    stray = f"/tmp/slime-fuzz-{uuid.uuid4().hex}"
    routes = registered_routes()
    assert ("POST", "/slime/dump_parameters") in routes and ("GET", "/health") in routes
    todo = cases(env, routes, stray)
    assert 300 < len(todo) < 700, len(todo)
    before_outside = listing(env.root) - listing(env.dumps)

    async def scenario() -> list[str]:
        problems = []
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(headers=AUTH, timeout=timeout) as s:
            for method, path, body in todo:
                status, text = await send(s, env.url, method, path, body)
                released = status == 503 and ("released" in text or "not loaded" in text)
                if status >= 500 and not released:
                    problems.append(f"{method} {path} {body[:80]!r} -> {status} {text[:300]}")
                if path == "/pause_generation":
                    await send(s, env.url, "POST", "/continue_generation", b"")
            # Bring the weights back, then the engine must serve as before.
            assert (await send(s, env.url, "POST", "/resume_memory_occupation", b"{}"))[0] < 500
            ok = json.dumps({"model_path": tiny_model}).encode()
            assert (await send(s, env.url, "POST", "/update_weights_from_disk", ok))[0] == 200
            assert (await send(s, env.url, "GET", "/health_generate", b""))[0] == 200
            gen = json.dumps({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}).encode()
            status, text = await send(s, env.url, "POST", "/generate", gen)
            assert status == 200 and json.loads(text)["meta_info"]["completion_tokens"] == 2
        return problems

    problems = asyncio.run(scenario())
    assert not problems, "\n".join(problems[:20])
    assert listing(env.root) - listing(env.dumps) == before_outside  # nothing new outside dumps/
    assert not os.path.lexists(stray) and not os.path.lexists(env.outside / "victim")
    assert os.listdir(env.outside) == []
    assert os.path.isfile(env.dumps / "ok" / PARAM)  # the one valid dump happened


@pytest.mark.parametrize(
    "path, status, message",
    [
        ("/proc/self/mem", 403, "outside the directory this engine may dump into"),
        ("../outside/x", 403, "outside the directory"),
        ("escape/x", 403, "outside the directory"),
        ("planted", 400, "cannot write the parameter dump"),
        (7, 400, "'path' must be a directory path"),
    ],
)
def test_dump_parameters_refuses_paths_outside_the_dump_directory(fuzz_engine, path, status, message):
    async def scenario():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            return await send(
                s, fuzz_engine.url, "POST", "/slime/dump_parameters", json.dumps({"path": path}).encode()
            )

    code, text = asyncio.run(scenario())
    assert code == status and message in json.loads(text)["message"], text
    if status == 403:
        assert str(fuzz_engine.dumps) in json.loads(text)["message"]  # names the allowed directory
    assert os.listdir(fuzz_engine.outside) == []


def test_dump_parameters_without_a_dump_directory_says_how_to_enable_it(tiny_model, tmp_path):
    with start_torch_engine(tiny_model, ENGINE_ARGS, str(tmp_path / "engine.log")) as eng:

        async def scenario():
            async with aiohttp.ClientSession() as s:
                return await send(
                    s,
                    eng.url,
                    "POST",
                    "/slime/dump_parameters",
                    json.dumps({"path": str(tmp_path / "d")}).encode(),
                )

        code, text = asyncio.run(scenario())
    assert code == 403 and "--debug-dump-dir" in json.loads(text)["message"]
    assert not (tmp_path / "d").exists()
