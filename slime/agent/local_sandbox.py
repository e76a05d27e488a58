"""`LocalSandbox` (ours): a sandbox that needs no account (slime.agent.sandbox has the contract).

Every command is a subprocess in the sandbox's own temporary directory, which its commands also
see as /tmp, with a time limit (the command and every process it started are killed), a memory
limit, a cap on the output kept, and no network (a network namespace of its own) unless asked.
Leaving the context kills whatever is still running and deletes the directory.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shlex
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from slime.agent.sandbox import ExecResult, FileContent

logger = logging.getLogger(__name__)

EXIT_TIMEOUT = 124
"""LocalSandbox.exec's exit code for a command killed at its timeout (coreutils' `timeout`'s)."""


@functools.cache
def _namespaces_work() -> bool:
    """Whether this machine lets an unprivileged user make network and mount namespaces."""
    try:
        return subprocess.run(["unshare", "-rnm", "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class LocalSandbox:
    """A sandbox on this machine that needs no account (module docstring). `network`: let
    commands reach the network (default: none, not even loopback); `memory_mb`: each command's
    address-space limit; `max_output_bytes`: stdout and stderr kept per command (the rest is
    read and dropped, the result says so)."""

    single_user = True
    poll_interval_s = 0.05

    def __init__(
        self,
        *,
        network: bool = False,
        memory_mb: int = 2048,
        max_output_bytes: int = 1 << 20,
        max_file_mb: int = 256,
        env: dict[str, str] | None = None,
        root: str | None = None,
    ) -> None:
        """`root`: the directory the sandbox's own directory is made in (not under /tmp)."""
        self.network, self.memory_mb, self.max_output_bytes = network, memory_mb, max_output_bytes
        self.max_file_mb = max_file_mb
        self.env = dict(env or {})
        self._parent = root
        self.root = ""
        self._namespaces = False
        self.sandbox_id = f"local-{uuid.uuid4().hex[:12]}"

    @property
    def tmp_dir(self) -> str:
        """The sandbox's /tmp as its commands see it (its own, in a mount namespace)."""
        return "/tmp" if self._namespaces else os.path.join(self.root, "tmp")

    async def __aenter__(self) -> LocalSandbox:
        self._namespaces = _namespaces_work()
        if not self.network and not self._namespaces:
            raise RuntimeError(
                "LocalSandbox(network=False) needs unprivileged user namespaces (`unshare -rnm true` "
                "fails here): enable them (sysctl kernel.unprivileged_userns_clone=1) or pass "
                "network=True to run commands without network isolation (and without a /tmp of their own)"
            )
        parent = self._parent or _sandbox_parent()
        if self._namespaces and (os.path.realpath(parent) + "/").startswith("/tmp/"):
            raise ValueError(
                f"LocalSandbox(root={parent!r}): not under /tmp, which its commands see as their own"
            )
        _sweep_abandoned(parent)
        self.root = os.path.join(parent, f"slime-sandbox-{self.sandbox_id}-{os.getpid()}")
        os.makedirs(os.path.join(self.root, "tmp"))
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.kill_all()
        shutil.rmtree(self.root, ignore_errors=True)

    def kill_all(self) -> int:
        """Kill every process any command of this sandbox started, detached ones included (found
        by the sandbox id in their environment); how many. A process that clears its environment
        (`env -i`) is not found: commands are contained, not confined. One pass can miss a
        process caught between fork and exec (its environment unreadable for that instant), so
        passes repeat until one finds nothing, two at least."""
        total = 0
        for attempt in range(20):
            found = _kill_marked(f"SLIME_SANDBOX_ID={self.sandbox_id}")
            total += found
            if attempt and not found:
                break
            time.sleep(0.01)
        return total

    def host_path(self, sandbox_path: str) -> str:
        """Where a sandbox path lies here: /tmp/... is the sandbox's tmp, a relative path is under
        its root; any other absolute path is refused."""
        if not self.root:
            raise RuntimeError("the sandbox is not started: use `async with LocalSandbox() as sb`")
        path = os.path.normpath(sandbox_path)
        if self._namespaces and (path == "/tmp" or path.startswith("/tmp/")):
            path = os.path.join(self.root, path[1:])
        elif os.path.isabs(path) and not path.startswith(self.root + os.sep):
            raise ValueError(
                f"{sandbox_path!r} is outside the sandbox: use /tmp/... or a path relative to its root"
            )
        else:
            path = os.path.join(self.root, path)
        if os.path.commonpath([os.path.realpath(path), os.path.realpath(self.root)]) != os.path.realpath(
            self.root
        ):
            raise ValueError(f"{sandbox_path!r} leaves the sandbox")
        return path

    def _argv(self, cmd: str) -> list[str]:
        limits = f"ulimit -v {self.memory_mb * 1024}; ulimit -f {self.max_file_mb * 1024}"
        if not self._namespaces:
            return ["bash", "-c", f"{limits}; {cmd}"]
        tmp = shlex.quote(os.path.join(self.root, "tmp"))
        flags = "-rm" if self.network else "-rnm"
        return ["unshare", flags, "bash", "-c", f"mount --bind {tmp} /tmp && {limits}; {cmd}"]

    async def exec(
        self,
        cmd: str,
        *,
        user: str = "root",
        env: dict[str, str] | None = None,
        timeout: int = 120,
        check: bool = False,
        idempotent: bool = True,
    ) -> ExecResult:
        """Run `cmd` with bash in the sandbox's root: (exit code, stdout, stderr). At `timeout` s
        the command and its process group are killed (exit code 124). `user` is not switched:
        every command runs as this machine's user."""
        base = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": self.root,
            "TMPDIR": self.tmp_dir,
            "LANG": "C.UTF-8",
        }
        command = uuid.uuid4().hex  # marks every process of this command, detached ones included
        proc = await asyncio.create_subprocess_exec(
            *self._argv(cmd),
            cwd=self.root,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
            env={
                **base,
                **self.env,
                **(env or {}),
                "SLIME_SANDBOX_ID": self.sandbox_id,
                "SLIME_SANDBOX_COMMAND": command,
            },
        )
        assert proc.stdout is not None and proc.stderr is not None
        reads = asyncio.gather(self._read(proc.stdout), self._read(proc.stderr))
        try:
            (out, out_cut), (err, err_cut) = await asyncio.wait_for(asyncio.shield(reads), timeout)
            code = await proc.wait()
        except asyncio.TimeoutError:
            # The group, and what left it (setsid) but keeps the output pipes open.
            _kill_group(proc.pid)
            _kill_marked(f"SLIME_SANDBOX_COMMAND={command}")
            try:
                (out, out_cut), (err, err_cut) = await asyncio.wait_for(reads, 10)
            except asyncio.TimeoutError:  # a process that cleared its environment holds them
                (out, out_cut), (err, err_cut) = ("", False), ("", False)
            await proc.wait()
            code, err = EXIT_TIMEOUT, err + f"\n[slime sandbox: killed after the {timeout} s timeout]"
        if out_cut or err_cut:
            err += f"\n[slime sandbox: output beyond {self.max_output_bytes} bytes was dropped]"
        if check and code != 0:
            raise RuntimeError(f"sandbox command failed (exit {code}): {cmd[:120]}\n{err[-400:]}")
        return code, out, err

    async def _read(self, stream: asyncio.StreamReader) -> tuple[str, bool]:
        kept, size, cut = [], 0, False
        while chunk := await stream.read(65536):
            if size < self.max_output_bytes:
                kept.append(chunk[: self.max_output_bytes - size])
            cut = cut or size + len(chunk) > self.max_output_bytes
            size += len(chunk)
        return b"".join(kept).decode("utf-8", "replace"), cut

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None:
        path = self.host_path(sandbox_path)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if isinstance(content, Path):
            shutil.copyfile(content, path)
        else:
            with open(path, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        """The file's text; "" when it does not exist (slime's)."""
        try:
            with open(self.host_path(sandbox_path), "rb") as f:
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""


def _sweep_abandoned(parent: str) -> None:
    """Remove the sandboxes a process that is gone left behind (killed before it left them): their
    processes, then their directories. A sandbox's directory names its id and its process."""
    for name in os.listdir(parent):
        parts = name.split("-")
        if len(parts) != 5 or parts[:3] != ["slime", "sandbox", "local"] or not parts[4].isdigit():
            continue
        if os.path.exists(f"/proc/{parts[4]}"):
            continue  # its process lives (or the pid was reused: left alone)
        _kill_marked(f"SLIME_SANDBOX_ID=local-{parts[3]}")
        shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _sandbox_parent() -> str:
    for parent in ("/var/tmp", os.path.expanduser("~/.cache/slime/sandboxes")):
        os.makedirs(parent, exist_ok=True)
        if os.access(parent, os.W_OK):
            return parent
    raise RuntimeError(
        "LocalSandbox: neither /var/tmp nor ~/.cache/slime/sandboxes is writable; pass root=DIR"
    )


def _kill_marked(marker: str) -> int:
    """SIGKILL every process of this user whose environment holds `marker` (NAME=VALUE); how many."""
    wanted, killed = marker.encode(), 0
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if wanted not in f.read().split(b"\0"):
                    continue
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except OSError:  # gone, or not ours
            continue
    return killed


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
