"""`--rollout-backend sglang` launched by slime: engine actors, command line, readiness, router,
colocated memory calls, weight pushes, restarts.

SGLang cannot run on this CPU machine, so `python -m sglang.launch_server` resolves to the test
stand-in in tests/fake_sglang (SGLang's command line, slime's torch engine behind it). Everything
on slime's side is the real code path: Ray actors, the command each actor builds, the
/health_generate wait, the sglang-router from PyPI, the pushes and the memory release order.
"""

from __future__ import annotations

import itertools
import json
import os
import re

import pytest

from tests.test_loop_e2e import ROOT, prompts, run_job  # noqa: F401 - fixture

pytest.importorskip("sglang_router", reason="sglang-router is not installed (pip install sglang-router)")

FAKE = os.path.join(ROOT, "tests", "fake_sglang")

ROUTER_GENERATE = """
import json, os, urllib.request
from slime.rollout.default_generate import apply_response

def generate(args, sample, sampling_params):
    # What a user's generate function does: one request to the router slime put in front of the engines.
    body = {"input_ids": sample.tokens, "sampling_params": sampling_params, "return_logprob": True}
    req = urllib.request.Request(f"http://{args.sglang_router_ip}:{args.sglang_router_port}/generate",
                                 data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        output = json.loads(resp.read())
    with open(os.environ["ROUTER_CALLS_LOG"], "a") as f:
        f.write(args.sglang_router_ip + ":" + str(args.sglang_router_port) + "\\n")
    return apply_response(sample, sample.tokens, output)
"""

pytestmark = pytest.mark.e2e


def sglang_job(model, prompts, tmp_path, *extra, env=None):
    record = tmp_path / "launches.jsonl"
    proc = run_job(
        "train.py",
        model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--rollout-backend",
        "sglang",
        *extra,
        env={"FAKE_SGLANG_RECORD": str(record), **(env or {})},
        path=[FAKE],
    )
    launches = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return proc, launches


def engine_events(log: str) -> list[str]:
    """The engine's memory calls and weight pushes, in order (consecutive updates are one push)."""
    events: list[str] = []
    for line in log.splitlines():
        if m := re.search(r"memory (released|resumed) \[([^\]]*)\]", line):
            events.append(f"{m.group(1)} {m.group(2)}".replace("'", ""))
        elif "/update_weights_from_" in line and (not events or events[-1] != "push"):
            events.append("push")
    return events


def test_colocated_sglang_engines_release_and_resume_in_order(tiny_model, prompts, tmp_path):
    proc, launches = sglang_job(
        tiny_model,
        prompts,
        tmp_path,
        "--colocate",
        "--update-weight-transport",
        "distributed",
        "--sglang-mem-fraction-static",
        "0.5",
        "--sglang-cuda-graph-bs",
        "1",
        "2",
        "--check-precision",
        "--deterministic-mode",
        "--seed",
        "7",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # One server, started with slime's settings and exactly the --sglang-* flags given.
    assert len(launches) == 1
    argv = launches[0]["argv"]
    opts = dict(itertools.pairwise(argv))
    assert opts["--model-path"] == tiny_model and opts["--tp-size"] == "1" and opts["--random-seed"] == "7"
    assert opts["--weight-version"] == "0" and opts["--host"] == "127.0.0.1" and opts["--nccl-port"].isdigit()
    assert "--enable-memory-saver" in argv and "--enable-deterministic-inference" in argv
    assert argv[argv.index("--mem-fraction-static") :][:2] == ["--mem-fraction-static", "0.5"]
    assert argv[argv.index("--cuda-graph-bs") :][:3] == ["--cuda-graph-bs", "1", "2"]
    assert launches[0]["cuda_visible_devices"] is None  # a CPU cluster has no GPU ids to give
    assert "--check-precision: passed at rollout 0" in proc.stderr
    # On the engine, in order: the --check-precision push before rollout 0; then per rollout all
    # memory released for training, the weights back before the push, KV cache and CUDA graphs after.
    events = engine_events((tmp_path / "logs" / "engine0.log").read_text())
    per_rollout = [
        "released weights, kv_cache, cuda_graph",
        "resumed weights",
        "push",
        "resumed kv_cache, cuda_graph",
    ]
    assert events == ["push", *per_rollout, *per_rollout], events
    assert (tmp_path / "logs" / "router.log").exists()


def test_disaggregated_sglang_engines_behind_the_router(tiny_model, prompts, tmp_path):
    (tmp_path / "router_gen.py").write_text(ROUTER_GENERATE)
    calls = tmp_path / "router_calls.txt"
    proc, launches = sglang_job(
        tiny_model,
        prompts,
        tmp_path,
        "--rollout-num-gpus",
        "2",
        "--update-weight-transport",
        "tensor",
        "--custom-generate-function-path",
        "router_gen.generate",
        "--check-weight-update-equal",
        env={"ROUTER_CALLS_LOG": str(calls)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(launches) == 2 and len({json.dumps(x["argv"]) for x in launches}) == 2  # own ports each
    assert "--enable-memory-saver" not in launches[0]["argv"]
    # Both engines registered with the router slime started; every sample went through it.
    registered = re.search(r"router (http://\S+) in front of engines (\S+, \S+)", proc.stderr)
    assert registered, proc.stderr[-3000:]
    lines = calls.read_text().split()
    assert len(lines) == 2 * 4 * 2 and len(set(lines)) == 1
    assert registered.group(1) == "http://" + lines[0]
    # SGLang's /weights_checker: snapshot, noise, the first push, compare (what SGLang engines can answer).
    assert "after the first push every engine parameter equals the checkpoint" in proc.stderr


# ~39 s; the engines behind a router also run in test_disaggregated_sglang_engines_behind_the_router
@pytest.mark.slow
def test_engines_register_with_a_running_router_and_leave_it_when_done(tiny_model, prompts, tmp_path):
    from slime.engines.router import Router

    router = Router.start("127.0.0.1", str(tmp_path / "router.log"))
    try:
        proc = run_job(
            "train.py",
            tiny_model,
            prompts,
            tmp_path,
            "--rm-type",
            "exact",
            "--rollout-num-gpus",
            "2",
            "--sglang-router-ip",
            router.host,
            "--sglang-router-port",
            str(router.port),
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert re.search(rf"router {re.escape(router.url)} in front of engines \S+, \S+", proc.stderr)
        assert router.workers() == {}  # slime removed the engines it registered; the router runs on
    finally:
        router.stop()
    (tmp_path / "bad").mkdir()
    bad = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path / "bad",
        "--rm-type",
        "exact",
        "--sglang-router-ip",
        "127.0.0.1",
        "--sglang-router-port",
        "9",
    )
    # A router that does not answer: one line, exit 2, before any process starts.
    errors = [line for line in bad.stderr.splitlines() if " ERROR " in line]
    assert bad.returncode == 2 and len(errors) == 1, bad.stderr[-3000:]
    assert "no sglang-router answers at http://127.0.0.1:9" in errors[0] and "slime job" not in bad.stderr
