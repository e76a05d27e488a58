"""API keys of engines that leave loopback: the torch engine answers 401 without the key on every
route but /health* (as SGLang), the client sends it, and the key shows in no log, no command line
(/proc/<pid>/cmdline) and no repr. The same for an SGLang server (the test stand-in behind
SGLang's command line) and the sglang-router in front of the engines."""

from __future__ import annotations

import asyncio
import os
import time

import aiohttp
import pytest

from slime.engines.client import ClientConfig, EngineClient, EngineError
from slime.engines.protocol import new_api_key
from slime.engines.sglang_server import SGLangLaunch, start_sglang_server
from slime.engines.torch_engine.launcher import OutputSink, start_torch_engine
from slime.utils.net import free_port
from tests.conftest import ENGINE_ARGS
from tests.test_engine_fuzz import registered_routes

KEY = new_api_key()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_SGLANG = os.path.join(ROOT, "tests", "fake_sglang")
GENERATE = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def keyed_engine(tiny_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("auth") / "engine.log"
    proc = start_torch_engine(tiny_model, ENGINE_ARGS, str(log), api_key=KEY)
    yield proc
    assert proc.stop() in (0, -15)
    assert KEY not in log.read_text()  # every test of the module ran against it by now


def cmdline(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()


async def status_of(url: str, method: str, path: str, headers: dict[str, str], body: object = None) -> int:
    async with (
        aiohttp.ClientSession(headers=headers) as s,
        s.request(method, url + path, json=body) as resp,
    ):
        return resp.status


def test_generated_keys_pass_as_a_command_line_value():
    """SGLang gets the key as `--api-key KEY` (from its --config file): a key that starts with
    "-" would be taken for a flag. 2,000 keys (one in 32 started so, before)."""
    from slime.engines.torch_engine.cli import build_parser

    keys = {new_api_key() for _ in range(2000)}
    assert len(keys) == 2000 and not any(k.startswith("-") for k in keys)
    assert build_parser().parse_args(["--model-path", "m", "--api-key", min(keys)]).api_key == min(keys)


def test_every_route_but_health_needs_the_key(keyed_engine):
    url = keyed_engine.url
    wrong = [
        {},
        {"Authorization": "Bearer wrong-key"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"Authorization": "Bearer \u00e9\u00e8"},
    ]

    async def scenario() -> list[str]:
        problems = []
        for method, path in registered_routes():
            for headers in wrong:
                status = await status_of(url, method, path, headers)
                if (status == 401) == path.startswith("/health"):
                    problems.append(f"{method} {path} {headers}: {status}")
        for path in ("/health", "/health_generate"):  # open, as SGLang's (routers and probes)
            assert await status_of(url, "GET", path, {}) == 200
        for method, path in registered_routes():
            if method == "GET":
                assert await status_of(url, "GET", path, {"Authorization": f"bearer {KEY}"}) == 200, path
        assert await status_of(url, "GET", "/no_such_route", {}) == 401  # nothing is learnt without the key
        return problems

    assert asyncio.run(scenario()) == []


def test_the_client_with_the_key_works_and_never_shows_it(keyed_engine):
    config = ClientConfig(api_key=KEY)
    assert KEY not in repr(config) and KEY not in repr(keyed_engine)
    with pytest.raises(ValueError) as bad:
        ClientConfig(api_key=f"{KEY} \n")
    assert KEY not in str(bad.value)

    async def scenario():
        async with EngineClient(keyed_engine.url, config) as c:
            out = await c.generate([1, 2], sampling_params={"max_new_tokens": 2})
            assert out["meta_info"]["completion_tokens"] == 2
            assert await c.health_generate()
            with pytest.raises(EngineError) as refused:  # a 4xx with the key: no key in the error
                await c.generate([1, 2], sampling_params={"max_new_tokens": -1})
            assert refused.value.status == 400 and KEY not in str(refused.value)
        async with EngineClient(keyed_engine.url) as anonymous:
            with pytest.raises(EngineError) as unauthorized:
                await anonymous.generate([1, 2])
            assert unauthorized.value.status == 401

    asyncio.run(scenario())


def test_the_key_is_on_no_command_line(keyed_engine, tiny_model, tmp_path):
    assert KEY not in cmdline(keyed_engine.proc.pid)
    assert os.environ.get("SLIME_ENGINE_API_KEY") is None
    with pytest.raises(ValueError, match="not as --api-key"):
        start_torch_engine(tiny_model, ["--api-key", KEY], str(tmp_path / "x.log"))


def test_forwarded_output_is_scrubbed_of_the_key_even_split_across_reads(tmp_path):
    log = tmp_path / "out.log"
    sink = OutputSink(str(log), 1, KEY)
    text = f"api_key={KEY} twice {KEY}{KEY[:5]}, a prefix at the end: {KEY[:7]}".encode()
    for i in range(0, len(text), 3):  # every split of the key across two reads
        sink.write(text[i : i + 3])
    sink.close()
    assert log.read_text() == f"api_key=*** twice ***{KEY[:5]}, a prefix at the end: {KEY[:7]}"


def test_the_api_key_flag_for_engines_started_by_hand(tiny_model, capsys):
    from slime.engines.torch_engine.cli import build_parser, validate

    parser = build_parser()
    args = parser.parse_args(["--model-path", tiny_model, "--api-key", KEY])
    validate(args, parser)
    assert args.api_key == KEY
    bad = "has a space " + KEY
    with pytest.raises(SystemExit) as e:
        validate(parser.parse_args(["--model-path", tiny_model, "--api-key", bad]), parser)
    assert e.value.code == 2 and KEY not in capsys.readouterr().err


def test_sglang_gets_the_key_in_a_config_file_and_its_log_is_scrubbed(tiny_model, tmp_path):
    launch = SGLangLaunch(
        tiny_model, 1, "127.0.0.1", free_port("127.0.0.1"), free_port("127.0.0.1"), 0, api_key=KEY
    )
    assert KEY not in repr(launch) and KEY not in " ".join(launch.command())
    with pytest.raises(ValueError, match="--sglang-config"):
        SGLangLaunch(tiny_model, 1, "127.0.0.1", 1, 2, 0, extra_args=("--config", "x.yaml"), api_key=KEY)
    log = tmp_path / "engine0.log"
    env = {"PYTHONPATH": os.pathsep.join([FAKE_SGLANG, ROOT, os.environ.get("PYTHONPATH", "")])}
    server = start_sglang_server(launch, None, str(log), timeout_s=180, env=env)
    try:
        assert KEY not in cmdline(server.proc.pid)
        config = server.args[server.args.index("--config") + 1]
        assert not os.path.exists(config)  # read at start-up, then removed

        async def scenario():
            assert await status_of(server.url, "POST", "/generate", {}, GENERATE) == 401
            auth = {"Authorization": f"Bearer {KEY}"}
            assert await status_of(server.url, "POST", "/generate", auth, GENERATE) == 200

        asyncio.run(scenario())
    finally:
        server.stop()
    text = log.read_text()
    assert "'api_key': '***'" in text and KEY not in text  # the stand-in logs it, as SGLang does


def test_the_router_requires_the_key_and_forwards_it(keyed_engine, tmp_path):
    pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install sglang-router)")
    from slime.engines.router import Router

    log = tmp_path / "router.log"
    router = Router.start("127.0.0.1", str(log), api_key=KEY)
    try:
        assert router.proc is not None and KEY not in cmdline(router.proc.pid) and KEY not in repr(router)
        router.add_worker(keyed_engine.url)
        auth = {"Authorization": f"Bearer {KEY}"}

        async def scenario():
            assert await status_of(router.url, "POST", "/generate", {}, GENERATE) == 401
            assert (
                await status_of(router.url, "POST", "/generate", {"Authorization": "Bearer x"}, GENERATE)
                == 401
            )
            deadline = time.monotonic() + 60
            while (status := await status_of(router.url, "POST", "/generate", auth, GENERATE)) != 200:
                assert time.monotonic() < deadline, status  # the router checks the worker's health first
                await asyncio.sleep(0.5)
            assert await status_of(router.url, "GET", "/workers", {}) == 401  # its control plane too

        asyncio.run(scenario())
        router.remove_worker(keyed_engine.url)
        assert router.workers() == {}
    finally:
        router.stop()
    assert KEY not in log.read_text()


def test_the_engines_key_a_job_chooses(monkeypatch):
    """SLIME_ENGINE_API_KEY is the key of the engines a job starts, on loopback too; without it
    they get a random key off loopback and none on it; engines given by address get none."""
    from slime.ray.job import engine_api_key

    monkeypatch.delenv("SLIME_ENGINE_API_KEY", raising=False)
    assert engine_api_key(external=False, off_loopback=False) is None
    first, second = engine_api_key(False, True), engine_api_key(False, True)
    assert first and second and first != second  # a job's own
    monkeypatch.setenv("SLIME_ENGINE_API_KEY", KEY)
    assert engine_api_key(False, False) == KEY and engine_api_key(False, True) == KEY
    assert engine_api_key(external=True, off_loopback=True) is None


def scrape_metrics(phase, info):
    """--debug-phase-hook of the job below: after a rollout, each engine's /metrics without and
    with the key the job was given, the answers' codes appended to $SCRAPES."""
    import urllib.error
    import urllib.request

    if phase != "rollout_done":
        return
    for url in info["engines"]:
        for headers in ({}, {"Authorization": f"Bearer {os.environ['SLIME_ENGINE_API_KEY']}"}):
            try:
                with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=headers)) as r:
                    code = r.status
            except urllib.error.HTTPError as e:
                code = e.code
            with open(os.environ["SCRAPES"], "a") as f:
                f.write(f"{code}\n")


@pytest.mark.slow  # ~20 s
@pytest.mark.e2e
def test_a_job_gives_its_engines_the_key_it_was_given(tiny_model, tmp_path):
    """On loopback, with SLIME_ENGINE_API_KEY: the engines require that key (a Prometheus scrape
    without it is refused, with it answered), and the job, which sends it, runs."""
    from tests.test_loop_e2e import run_job

    prompts = tmp_path / "train.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n' * 4)
    scrapes = tmp_path / "scrapes.txt"
    env = {"SLIME_ENGINE_API_KEY": KEY, "SCRAPES": str(scrapes)}
    hook = "tests.test_engine_auth.scrape_metrics"
    proc = run_job(
        "train.py",
        tiny_model,
        str(prompts),
        tmp_path,
        "--rm-type",
        "exact",
        "--debug-phase-hook",
        hook,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert scrapes.read_text().split() == ["401", "200"] * 2  # two rollouts, one engine
    assert "API key required" in (tmp_path / "logs" / "engine0.log").read_text()
    assert KEY not in proc.stderr and KEY not in proc.stdout
