"""slime.agent.sandbox and slime.agent.harness: the local sandbox's limits (time, memory, output,
network, its own /tmp, killed with its children), exec_and_wait, the harness lifecycle, and the
E2B sandbox and CLI harnesses refused by name where their dependencies are missing."""

from __future__ import annotations

import os
import re
import subprocess
import time

import pytest

from slime.agent.harness import BaseHarness, ClaudeCodeHarness, CodexHarness, HarnessContext, run_agent
from slime.agent.local_sandbox import EXIT_TIMEOUT, LocalSandbox, _namespaces_work
from slime.agent.sandbox import EXIT_TIME_BUDGET_EXCEEDED, E2BSandbox, Sandbox, exec_and_wait
from slime.utils.async_utils import run_sync

needs_namespaces = pytest.mark.skipif(not _namespaces_work(), reason="no unprivileged user namespaces here")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


@needs_namespaces
def test_commands_run_in_their_own_directory_and_tmp_without_network():
    async def go():
        async with LocalSandbox() as sb:
            assert isinstance(sb, Sandbox)
            await sb.write_file("/tmp/in.txt", "hello")
            await sb.write_file("work/script.py", "print(open('/tmp/in.txt').read() * 2)")
            code, out, err = await sb.exec("python3 work/script.py && echo $PWD")
            assert (code, out.split()[0], err) == (0, "hellohello", "")
            assert out.split()[1] == sb.root
            assert not os.path.exists("/tmp/in.txt") or open("/tmp/in.txt").read() != "hello"
            code, _, err = await sb.exec(
                "python3 -c \"import urllib.request as u; u.urlopen('http://127.0.0.1:9', timeout=2)\""
            )
            assert code != 0 and "URLError" in err  # no network, not even loopback
            await sb.exec("echo out > /tmp/made.txt")
            assert await sb.read_file("/tmp/made.txt") == "out\n" and await sb.read_file("/tmp/none") == ""
            with pytest.raises(ValueError, match="outside the sandbox"):
                await sb.write_file("/etc/passwd", "x")
            with pytest.raises(ValueError, match="leaves the sandbox"):
                await sb.read_file("../../etc/passwd")
            return sb.root

    root = run_sync(go())
    assert not os.path.exists(root)  # deleted on exit


@needs_namespaces
def test_time_memory_and_output_limits():
    async def go():
        async with LocalSandbox(memory_mb=256, max_output_bytes=1000) as sb:
            start = time.monotonic()
            code, out, err = await sb.exec("(sleep 30 &) ; echo started; sleep 30", timeout=1)
            assert code == EXIT_TIMEOUT and out == "started\n" and "killed after the 1 s timeout" in err
            assert time.monotonic() - start < 20
            code, _, err = await sb.exec('python3 -c "x = bytearray(600 * 2**20)"')
            assert code != 0 and "MemoryError" in err
            code, out, err = await sb.exec("head -c 5000 /dev/zero | tr '\\0' a")
            assert code == 0 and out == "a" * 1000 and "output beyond 1000 bytes was dropped" in err
            with pytest.raises(RuntimeError, match="exit 3"):
                await sb.exec("exit 3", check=True)

    run_sync(go())


@needs_namespaces
def test_exec_and_wait_and_leaving_the_sandbox_kill_detached_commands():
    async def go():
        async with LocalSandbox() as sb:
            code, out = await exec_and_wait(
                sb, cmd="echo done; exit 4", time_budget_sec=10, tag="a", want_output=True
            )
            assert (code, out) == (4, "done\n")
            code, tail = await exec_and_wait(sb, cmd="echo boom >&2; exit 1", time_budget_sec=10, tag="b")
            assert code == 1 and "boom" in tail
            code, _ = await exec_and_wait(sb, cmd="sleep 60", time_budget_sec=1, tag="c")
            assert code == EXIT_TIME_BUDGET_EXCEEDED
            # A detached process that outlives its command, then the sandbox.
            await sb.exec("setsid sleep 300 > /dev/null 2>&1 & echo $! > /tmp/pid")
            pid = int((await sb.read_file("/tmp/pid")).strip())
            assert alive(pid)
        return pid

    pid = run_sync(go())
    # The kill is sent as the sandbox closes; the process is gone once the kernel has delivered it
    # (a loaded machine takes its time: the deadline only keeps a broken kill from hanging the run).
    deadline = time.monotonic() + 120
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


@needs_namespaces
def test_a_timed_out_command_whose_detached_child_holds_its_output_returns_and_the_child_dies():
    async def go():
        async with LocalSandbox() as sb:
            start = time.monotonic()
            code, _, _ = await sb.exec("setsid sleep 300 & echo $! > /tmp/child; sleep 300", timeout=1)
            assert code == EXIT_TIMEOUT and time.monotonic() - start < 20
            return int((await sb.read_file("/tmp/child")).strip())

    pid = run_sync(go())
    time.sleep(0.2)
    assert not alive(pid)


@needs_namespaces
def test_a_sandbox_left_by_a_dead_process_is_cleared_by_the_next():
    import pathlib
    import shutil
    import tempfile

    parent = pathlib.Path(tempfile.mkdtemp(dir="/var/tmp"))  # not under /tmp (the sandbox's own)
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = parent / f"slime-sandbox-local-0123456789ab-{dead.pid}"
    (left / "tmp").mkdir(parents=True)
    mine = parent / f"slime-sandbox-local-ba9876543210-{os.getpid()}"  # a live process's: kept
    mine.mkdir()

    async def go():
        async with LocalSandbox(root=str(parent)) as sb:
            return os.path.basename(sb.root)

    name = run_sync(go())
    try:
        assert not left.exists() and mine.exists() and not (parent / name).exists()
    finally:
        shutil.rmtree(parent)


class EchoHarness(BaseHarness):
    """A harness whose "agent" is a shell command writing what it was given."""

    name = "echo"

    async def install_cli(self, sb):
        pass

    async def write_config(self, sb, ctx: HarnessContext):
        await sb.write_file(f"{ctx.workdir}/config", ctx.adapter_url)

    async def launch_and_wait(self, sb, ctx, prompt, time_budget_sec):
        return await run_agent(
            sb,
            workdir=ctx.workdir,
            start_cmd=f"echo $KEY {prompt} $(cat config); exit 7",
            env={"KEY": ctx.session_id},
            time_budget_sec=time_budget_sec,
        )


@needs_namespaces
def test_a_harness_runs_its_agent_in_the_sandbox():
    async def go():
        async with LocalSandbox() as sb:
            workdir = f"{sb.root}/repo"
            os.makedirs(workdir)
            code = await EchoHarness().run(
                sb,
                workdir=workdir,
                session_id="sid-1",
                adapter_url="http://a:1",
                time_budget_sec=10,
                prompt="fix-it",
            )
            return code, await sb.read_file(f"{workdir}/.harness/trajectory.jsonl")

    assert run_sync(go()) == (7, "sid-1 fix-it http://a:1\n")
    assert EchoHarness() is EchoHarness()  # one per process, as slime's


def test_e2b_and_cli_harnesses_are_refused_by_name_where_missing(monkeypatch):
    try:
        import e2b  # noqa: F401

        pytest.skip("e2b is installed here")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match=r"E2BSandbox needs the e2b package \(pip install e2b\)"):
        run_sync(E2BSandbox("python:3.11").__aenter__())
    for harness, env in (
        (ClaudeCodeHarness(), "SLIME_AGENT_NODE_TARBALL"),
        (CodexHarness(), "SLIME_AGENT_NODE_TARBALL"),
    ):
        monkeypatch.delenv(env, raising=False)
        with pytest.raises(
            RuntimeError, match=f"the {harness.name} harness installs Node 22 .*: {env} is not set"
        ):
            run_sync(harness.install_cli(None))
    monkeypatch.setenv("SLIME_AGENT_NODE_TARBALL", "/no/such/node.tar.xz")
    with pytest.raises(RuntimeError, match=re.escape("names '/no/such/node.tar.xz', which does not exist")):
        run_sync(CodexHarness().install_cli(None))


# What slime's examples (examples/coding_agent_rl, snapshot of 2026-08-21) import from slime.agent.
SLIME_EXAMPLE_IMPORTS = {
    "slime.agent.adapters": ["AnthropicAdapter", "OpenAIAdapter"],
    "slime.agent.adapters.common": ["flatten_content", "TurnRecord", "BaseAdapter", "Session", "Reply"],
    "slime.agent.aiohttp_threaded": ["FilteredAccessLogger", "run_app_in_thread"],
    "slime.agent.harness": [
        "ClaudeCodeHarness",
        "CodexHarness",
        "BaseHarness",
        "HarnessContext",
        "run_agent",
    ],
    "slime.agent.sandbox": ["E2BSandbox", "Sandbox", "exec_and_wait", "ensure_agent_user"],
    "slime.agent.trajectory": ["TrajectoryManager", "TurnRecord", "DriftKind"],
    "slime.agent.parsing": ["parse_model_output", "parse_xml_tool_uses", "ParsedModelOutput"],
}


def test_the_names_slimes_agent_examples_import_resolve():
    import importlib

    for module, names in SLIME_EXAMPLE_IMPORTS.items():
        loaded = importlib.import_module(module)
        assert [n for n in names if not hasattr(loaded, n)] == [], module
