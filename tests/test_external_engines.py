"""--rollout-external-engine-addrs: a job attaches engines started by someone else (here, by the
test, the way a user starts the torch engine), pushes to them, and leaves them running."""

from __future__ import annotations

import asyncio

import pytest

from slime.engines.client import EngineClient
from slime.ray.cli import parse_args
from tests.conftest import start_engine
from tests.test_loop_e2e import prompts, run_job  # noqa: F401 - prompts is a fixture


@pytest.mark.e2e
@pytest.mark.slow  # ~25 s; the flags and an unreachable engine are checked below
def test_a_job_trains_with_two_external_engines_and_leaves_them_running(tiny_model, prompts, tmp_path):
    engines = [start_engine(tiny_model, tmp_path) for _ in range(2)]
    try:
        addrs = [e.url.removeprefix("http://") for e in engines]
        proc = run_job(
            "train.py",
            tiny_model,
            prompts,
            tmp_path,
            "--rm-type",
            "exact",
            "--check-weight-sync",
            "--rollout-external-engine-addrs",
            *addrs,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert f"2 × external engine (http://{addrs[0]}, http://{addrs[1]})" in proc.stderr
        assert proc.stderr.count("attached external engine http://127.0.0.1:") == 2
        assert "external engines: pushed the trainer's weights before the first rollout" in proc.stderr
        assert "EngineActor" not in proc.stderr  # nothing launched

        async def versions():
            out = []
            for e in engines:
                async with EngineClient(e.url) as c:
                    out.append((await c.get_server_info())["weight_version"])
            return out

        assert asyncio.run(versions()) == ["2", "2"]  # still running, with the trained weights
    finally:
        for e in engines:
            e.stop()


@pytest.mark.e2e
def test_an_unreachable_external_engine_is_a_usage_error(tiny_model, prompts, tmp_path):
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--rollout-external-engine-addrs",
        "127.0.0.1:9",
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "--rollout-external-engine-addrs: http://127.0.0.1:9 cannot be used" in proc.stderr
    assert "start that engine first or fix the address" in proc.stderr


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--rollout-external-engine-addrs", "localhost"], "expected HOST:PORT"),
        (["--rollout-external-engine-addrs", "a:1", "http://a:1"], "names an engine twice"),
        (["--rollout-external-engine-addrs", "a:1", "--colocate"], "drop --colocate"),
        (["--rollout-external-engine-addrs", "a:1", "--rollout-num-gpus", "2"], "drop --rollout-num-gpus"),
        (["--sglang-router-ip", "10.0.0.9"], "--sglang-router-ip and --sglang-router-port go together"),
    ],
)
def test_external_engine_flags_are_checked(tiny_model, tmp_path, capsys, extra, message):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = [
        "--hf-checkpoint",
        tiny_model,
        "--prompt-data",
        str(data),
        "--rollout-batch-size",
        "1",
        "--num-rollout",
        "1",
        "--rm-type",
        "exact",
    ]
    with pytest.raises(SystemExit) as e:
        parse_args([*base, *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err
    config = parse_args(
        [*base, "--rollout-external-engine-addrs", "10.0.0.5:30000", "http://10.0.0.6:30000/"]
    )
    assert config.cluster.external_engine_addrs == ("http://10.0.0.5:30000", "http://10.0.0.6:30000")
    assert config.cluster.num_engines == 2
    sglang = parse_args(
        [*base, "--rollout-backend", "sglang", "--rollout-external-engine-addrs", "10.0.0.5:30000"]
    )
    assert sglang.debug.precision_dtype == "bfloat16"  # SGLang serves bf16: the log-prob tolerances follow
