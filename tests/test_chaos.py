"""--use-fault-tolerance under faults: real engine processes (and the router, and train ranks)
killed with SIGKILL at a chosen phase of a step, by pid, from --debug-phase-hook (the moment is
the hook's, never a sleep's). Every run must end with exit code 0, every rollout must hold each of
its prompt groups exactly once and fully sampled (read from the dumps), and every push must pass
--check-weight-sync, restarted engines included. Real Ray, real engines, real kills.

The default run covers the fault matrix in one job (several kills, one per rollout); `slow` runs
each cell of it as a job of its own, with each transport for the kill during the push.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from tests.test_loop_e2e import ROOT, prompts, run_job  # noqa: F401 - prompts is a fixture

FAKE_SGLANG = os.path.join(ROOT, "tests", "fake_sglang")

# The hook the jobs run (--debug-phase-hook chaos.hook). CHAOS lists the kills:
#   phase[:key=value...]->target ; ...
# A kill fires once (a marker file per kill, since the hook runs in several processes), when the
# phase's info matches every key=value. target: `engine` (the engine the info names: `engine`,
# else the first of `engines`), `engine-busy` (that engine, at the first such phase where it has a
# request in flight), `engine-stop` (the same with SIGSTOP: an engine that hangs without dying),
# `engines` (every engine up), `router` (the one the info names),
# `self` (this process), or
# `await:admitted` (hold this phase until a restarted engine was admitted: the run then goes on
# long enough for a push to reach it, however long its restart took).
HOOK = r"""
import os, signal, psutil

def _pid_listening(url):
    port = int(url.rsplit(":", 1)[1])
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
            return c.pid
    raise RuntimeError(f"nothing listens at {url}")

def _busy(url):  # a request running or queued at the engine (its /metrics: no key on loopback)
    import urllib.request
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
            text = answer.read().decode()
    except OSError:  # an engine killed before (its restart not seen yet): nothing in flight there
        return False
    counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith(("sglang:num_running_reqs{", "sglang:num_queue_reqs{"))]
    return sum(counts) > 0

def _kill(pid, what, sig=signal.SIGKILL):
    print(f"CHAOS: killing {what} (pid {pid}, {signal.Signals(sig).name})", flush=True)
    os.kill(pid, sig)

def hook(phase, info):
    if phase == "admitted":
        open(os.path.join(os.environ["CHAOS_DIR"], "admitted"), "a").write(f"{info}\n")
    for k, spec in enumerate(s for s in os.environ.get("CHAOS", "").split(";") if s.strip()):
        when, target = spec.strip().split("->")
        name, *conds = when.split(":")
        if name != phase or any(str(info.get(c.split("=")[0])) != c.split("=")[1] for c in conds):
            continue
        if target == "engine-busy" and not _busy(info.get("engine") or info["engines"][0]):
            continue  # armed until the engine has a request in flight (which is then generated again)
        try:
            fd = os.open(os.path.join(os.environ["CHAOS_DIR"], f"fired{k}"), os.O_CREAT | os.O_EXCL)
            os.close(fd)
        except FileExistsError:
            continue
        print(f"CHAOS: {spec.strip()} at {phase} {info}", flush=True)
        if target in ("engine", "engine-busy", "engine-stop"):  # engine-stop: SIGSTOP, an engine that hangs
            url = info.get("engine") or info["engines"][0]
            sig = signal.SIGSTOP if target == "engine-stop" else signal.SIGKILL
            _kill(_pid_listening(url), f"engine {url}", sig)
        elif target == "engines":
            for url in info["engines"]:
                _kill(_pid_listening(url), f"engine {url}")
        elif target == "router":
            _kill(_pid_listening(info["router"]), "the sglang-router")
        elif target == "await:admitted":
            import time
            deadline = time.monotonic() + 300
            while not os.path.exists(os.path.join(os.environ["CHAOS_DIR"], "admitted")):
                if time.monotonic() > deadline:
                    raise RuntimeError("no restarted engine was admitted within 300 s")
                time.sleep(0.1)
        elif target == "self":
            _kill(os.getpid(), f"this process ({phase})")
"""

FT = [
    "--use-fault-tolerance",
    "--rollout-health-check-interval",
    "0.5",
    "--rollout-health-check-timeout",
    "5",
]
pytestmark = pytest.mark.e2e


def chaos_job(tmp_path, tiny_model, prompts, chaos, *extra, num_rollout=3, path=(), check=True):
    (tmp_path / "chaos.py").write_text(HOOK)
    template = str(tmp_path / "dumps" / "r_{rollout_id}.pt")
    proc = run_job(
        "train.py",
        tiny_model,
        prompts,
        tmp_path,
        "--rm-type",
        "exact",
        "--rollout-num-gpus",
        "2",
        *FT,
        "--debug-phase-hook",
        "chaos.hook",
        "--num-rollout",
        str(num_rollout),
        "--rollout-max-response-len",
        "48",
        "--save-debug-rollout-data",
        template,
        *(["--check-weight-sync"] if check else []),
        *extra,
        env={"CHAOS": chaos, "CHAOS_DIR": str(tmp_path)},
        path=path,
    )
    return proc, template


def assert_nothing_lost(proc, template, num_rollout, kills, pushes):
    out = proc.stdout + proc.stderr
    (Path(template).parent.parent / "job.out").write_text(out)  # for reading after a failure
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert out.count("CHAOS: killing") >= kills, out[-5000:]
    for i in range(num_rollout):
        samples = torch.load(template.format(rollout_id=i), weights_only=True)["samples"]
        groups = sorted(s["group_index"] for s in samples)
        assert groups == [g for g in range(4) for _ in range(2)], (i, groups)  # each group once, 2 samples
        assert len({s["metadata"]["prompt_index"] for s in samples}) == 4
        assert all(s["status"] in ("completed", "truncated") and s["response_length"] > 0 for s in samples)
    # Every push, to the restarted engines too, was checked tensor by tensor.
    assert len(re.findall(r"--check-weight-sync: \d+ tensors match on every engine", out)) >= pushes, out[
        -5000:
    ]
    assert "takes requests again" in out


@pytest.mark.slow  # ~60 s
def test_engines_killed_in_every_phase_of_a_step_lose_nothing(tiny_model, prompts, tmp_path):
    """One job, one fault per rollout: both engines at once during generation (rollout 0), one
    during generation while it has requests in flight (rollout 1), one between the generation and
    the push (rollout 2), one during the push after its first bucket (version 4)."""
    chaos = (
        "group_generated:rollout_id=0:evaluation=False:groups=1->engines;"
        "group_generated:rollout_id=1:evaluation=False->engine-busy;"
        "rollout_done:rollout_id=2->engine;"
        "push_bucket:version=4:bucket=0->engine"
    )
    proc, template = chaos_job(
        tmp_path, tiny_model, prompts, chaos, "--update-weight-buffer-size", "65536", num_rollout=4
    )
    assert_nothing_lost(proc, template, 4, kills=5, pushes=4)
    assert "its group is generated again" in proc.stderr
    assert "pushing again to the others" in proc.stderr  # the push that lost an engine
    assert "every engine is down" in proc.stderr  # rollout 3 waited for a restart


CELLS = {
    "generation": ("group_generated:rollout_id=0:evaluation=False:groups=1->engine", []),
    "generation_hang": ("group_generated:rollout_id=0:evaluation=False:groups=1->engine-stop", []),
    "after_generation": ("rollout_done:rollout_id=0->engine", []),
    "push_tensor": ("push_bucket:version=1:bucket=0->engine", ["--update-weight-transport", "tensor"]),
    "push_distributed": (
        "push_bucket:version=1:bucket=0->engine",
        ["--update-weight-transport", "distributed"],
    ),
    "push_disk": ("push_bucket:version=1:bucket=0->engine", ["--update-weight-transport", "disk"]),
    "eval": (
        "group_generated:rollout_id=0:evaluation=True:groups=1->engine",
        ["--eval-interval", "1", "--eval-prompt-data", "PROMPTS", "--eval-temperature", "0"],
    ),
    "colocate_release": ("release->engine", ["--colocate", "--actor-num-gpus-per-node", "2"]),
    "colocate_resume": ("resume:tags=['weights']->engine", ["--colocate", "--actor-num-gpus-per-node", "2"]),
    "both_engines": ("group_generated:rollout_id=1:evaluation=False:groups=1->engines", []),
    "router": (
        "group_generated:rollout_id=0:evaluation=False:groups=1->router",
        ["--rollout-backend", "sglang"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("cell", sorted(CELLS))
def test_fault_matrix(tiny_model, prompts, tmp_path, cell):
    chaos, extra = CELLS[cell]
    if cell != "router":  # rollout 2 waits for the restart, so a push reaches the new engine
        chaos += ";group_generated:rollout_id=2:evaluation=False:groups=1->await:admitted"
    extra = [prompts if a == "PROMPTS" else a for a in extra]
    if cell.startswith("push"):
        extra += ["--update-weight-buffer-size", "65536"]
    proc, template = chaos_job(
        tmp_path,
        tiny_model,
        prompts,
        chaos,
        *extra,
        path=[FAKE_SGLANG] if cell == "router" else [],
        check=cell != "router",
    )
    if cell == "router":  # the engines stayed up; the router came back with both of them
        assert proc.returncode == 0, proc.stderr[-5000:]
        assert "CHAOS: killing the sglang-router" in proc.stdout + proc.stderr
        assert "router restarted at" in proc.stderr
        return
    assert_nothing_lost(proc, template, 3, kills=2 if cell == "both_engines" else 1, pushes=3)


# ~70 s each: slow. The default run keeps a failing rank ending the job (tests/test_hang.py) and a
# resume after a crash (tests/test_loop_e2e.py).
@pytest.mark.slow
@pytest.mark.parametrize(
    "phase, what", [("train", "the train step of rollout 2"), ("save", "the checkpoint save of rollout 2")]
)
def test_a_killed_train_rank_ends_the_job_and_the_run_resumes(tiny_model, prompts, tmp_path, phase, what):
    """Rank 1 of 2 killed in the train step (or the checkpoint save) of rollout 2: exit code 1 at
    once (not after a timeout) naming the rank and the phase; the checkpoint of rollout 1 is intact,
    and --load continues with rollout 2, training no rollout twice."""
    (tmp_path / "chaos.py").write_text(HOOK)
    save = str(tmp_path / "ckpt")
    common = [
        "--rm-type",
        "exact",
        "--actor-num-gpus-per-node",
        "2",
        "--save",
        save,
        "--save-interval",
        "1",
        "--num-rollout",
        "4",
        "--distributed-timeout-minutes",
        "5",
    ]
    env = {"CHAOS": f"{phase}:rank=1:rollout_id=2->self", "CHAOS_DIR": str(tmp_path)}
    proc = run_job(
        "train.py", tiny_model, prompts, tmp_path, *common, "--debug-phase-hook", "chaos.hook", env=env
    )
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert f"train rank 1 of 2 died during {what}" in proc.stderr, proc.stderr[-4000:]
    assert (
        f"The last complete checkpoint in {save} is of rollout 1; continue with --load {save}" in proc.stderr
    )
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "1"
    again = run_job("train.py", tiny_model, prompts, tmp_path, *common, "--load", save)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resumed after rollout 1" in again.stderr
    # Both runs write to one metrics file: every rollout was trained exactly once, in order.
    records = [json.loads(line) for line in open(tmp_path / "logs" / "metrics.jsonl")]
    assert [r["rollout_id"] for r in records if "rollout_id" in r] == [0, 1, 2, 3], records
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "3"
