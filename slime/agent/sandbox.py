"""Sandboxes an agent's commands run in (slime's contract): async context management, `exec`,
`write_file`, `read_file`.

- `LocalSandbox` (ours, in slime.agent.local_sandbox) needs no account: every command is a
  subprocess with a time limit, a memory limit and no network, in a directory of its own.
- `E2BSandbox` is slime's E2B client; it needs the `e2b` package and an E2B account, and is
  refused by name where the package is missing.
- `exec_and_wait` runs a long command detached and polls for its exit code (slime's protocol for
  sandboxes that cannot hold a stream open for a whole run); on the time budget it kills the
  command's process group.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import shlex
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

logger = logging.getLogger(__name__)

ExecResult = tuple[int, str, str]
FileContent = str | bytes | Path

EXIT_TIME_BUDGET_EXCEEDED = -1


@runtime_checkable
class Sandbox(Protocol):
    """What an agent rollout needs of a sandbox. `idempotent` tells a backend that retries
    transport failures whether sending the command again is safe."""

    sandbox_id: str

    async def __aenter__(self) -> Sandbox: ...

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None: ...

    async def exec(
        self,
        cmd: str,
        *,
        user: str = "root",
        env: dict[str, str] | None = None,
        timeout: int = 120,
        check: bool = False,
        idempotent: bool = True,
    ) -> ExecResult: ...

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None: ...

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str: ...


async def exec_and_wait(
    sb: Sandbox,
    *,
    cmd: str,
    time_budget_sec: int,
    tag: str,
    user: str = "root",
    env: dict[str, str] | None = None,
    workdir: str | None = None,
    out_file: str | None = None,
    want_output: bool = False,
) -> tuple[int, str]:
    """Run `cmd` to completion detached: (exit code, output). The output is the whole of it with
    `want_output`, else the last 512 bytes when the command failed. Past `time_budget_sec` the
    command's process group is killed and the exit code is EXIT_TIME_BUDGET_EXCEEDED (-1).
    Two calls with the same `tag` must not overlap."""
    tmp = getattr(sb, "tmp_dir", "/tmp")
    out_file = out_file or f"{tmp}/.{tag}.out"
    done, launcher, pid_file = f"{tmp}/.{tag}.done", f"{tmp}/.{tag}.sh", f"{tmp}/.{tag}.pid"
    guard = f"{tmp}/.{tag}.spawned"
    prefix = f"cd {shlex.quote(workdir)}\nexport HOME=/home/{user}\n" if workdir else ""
    # The command in a subshell: its `exit` must not skip the exit-code marker.
    body = f"#!/bin/bash\necho $$ > {pid_file}\n(\n{prefix}{cmd}\n)\necho $? > {done}\n"
    await sb.write_file(launcher, body, user=user)
    await sb.exec(f"rm -rf {guard}; rm -f {out_file} {done} {pid_file}", user=user, timeout=30, check=True)
    # The guard (slime's): a spawn sent again after a lost answer (a backend's retry) starts nothing.
    await sb.exec(
        f"chmod +x {launcher}; mkdir {guard} 2>/dev/null || exit 0; "
        f"setsid bash {launcher} < /dev/null > {out_file} 2>&1 &",
        user=user,
        env=env,
        timeout=30,
        check=True,
    )

    interval = float(getattr(sb, "poll_interval_s", 5.0))
    deadline = time.monotonic() + time_budget_sec
    code = EXIT_TIME_BUDGET_EXCEEDED
    while time.monotonic() < deadline:
        await asyncio.sleep(interval)
        status, out, _ = await sb.exec(f"test -f {done} && cat {done}", user=user, timeout=15)
        if status == 0 and out.strip():
            code = int(out.strip())
            break
    else:
        await sb.exec(f"test -f {pid_file} && kill -9 -- -$(cat {pid_file})", user=user, timeout=15)
    if want_output:
        return code, await sb.read_file(out_file, user=user)
    if code == 0:
        return code, ""
    _, tail, _ = await sb.exec(f"tail -c 512 {out_file} 2>/dev/null", user=user, timeout=15)
    return code, tail


async def ensure_agent_user(sb: Sandbox, workdir: str) -> None:
    """Create the unprivileged `agent` user that owns `workdir` (slime's); a sandbox of one user
    (LocalSandbox) has none to create."""
    if getattr(sb, "single_user", False):
        return
    await sb.exec(
        "id agent >/dev/null 2>&1 || useradd -m -s /bin/bash agent && chown -R agent:agent /home/agent "
        f"{workdir} && git config --system --add safe.directory '*' && id agent",
        user="root",
        check=True,
        timeout=60,
    )


def _getenv(*names: str, default: str = "") -> str:
    """The first non-empty of the environment variables `names` (a setting's name, then its
    older aliases)."""
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip():
            return value
    return default


class E2BSandbox:
    """slime's E2B sandbox (an `e2b.AsyncSandbox` from an image named in its metadata). Needs the
    `e2b` package, an E2B account (E2B_API_KEY) and SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY; refused
    by name at `async with` where the package is missing. Not run here: this machine has no E2B
    account or network."""

    image_metadata_key_env = ("SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY", "SWE_SANDBOX_IMAGE_METADATA_KEY")
    lifetime_sec_env = ("SLIME_AGENT_SANDBOX_LIFETIME_SEC", "SWE_SANDBOX_LIFETIME_SEC")
    rpc_retries_env = ("SLIME_AGENT_SANDBOX_RPC_RETRIES", "SWE_RPC_RETRIES")
    size_env = ("SLIME_AGENT_E2B_SANDBOX_SIZE", "SWE_E2B_SANDBOX_SIZE")
    default_lifetime_sec = 3600
    default_rpc_retries = 6
    default_size = "md"
    rpc_backoff_base_sec = 1.0
    rpc_backoff_cap_sec = 32.0
    _TRANSIENT = frozenset(
        {
            "ProtocolError",
            "LocalProtocolError",
            "WriteError",
            "ReadError",
            "ConnectError",
            "ConnectTimeout",
            "ReadTimeout",
            "WriteTimeout",
            "PoolTimeout",
            "RemoteProtocolError",
            "SSLError",
        }
    )

    def __init__(
        self,
        image: str,
        *,
        timeout: int | None = None,
        image_metadata_key: str | None = None,
        rpc_retries: int | None = None,
        size: str | None = None,
    ) -> None:
        self.image = image
        self.timeout = (
            timeout
            if timeout is not None
            else int(_getenv(*self.lifetime_sec_env, default=str(self.default_lifetime_sec)))
        )
        self.image_metadata_key = image_metadata_key or _getenv(*self.image_metadata_key_env) or None
        self.rpc_retries = (
            rpc_retries
            if rpc_retries is not None
            else int(_getenv(*self.rpc_retries_env, default=str(self.default_rpc_retries)))
        )
        self.size = size if size is not None else _getenv(*self.size_env, default=self.default_size)
        self._sb: Any = None
        self.sandbox_id = ""

    @classmethod
    def _is_transient(cls, e: BaseException) -> bool:
        name, text = type(e).__name__, str(e)
        if name == "SandboxException":
            return "does not exist" not in text and "STOPPED state" not in text
        return name in cls._TRANSIENT

    async def _rpc(self, what: str, call: Any, *, idempotent: bool = True) -> Any:
        """`await call()`, retried on transient E2B failures when `idempotent`."""
        from slime.utils.retry import RetryPolicy, retrying

        policy = RetryPolicy(
            max(1, self.rpc_retries), self.rpc_backoff_base_sec, 2.0, self.rpc_backoff_cap_sec
        )

        def on_retry(failures: int, e: BaseException, wait: float) -> None:
            logger.debug("[agent.sandbox] %s: %s, retry %d in %.1fs", what, type(e).__name__, failures, wait)

        return await retrying(call, policy, lambda e: idempotent and self._is_transient(e), on_retry)

    async def __aenter__(self) -> E2BSandbox:
        try:
            from e2b import AsyncSandbox
        except ImportError:
            raise RuntimeError(
                "E2BSandbox needs the e2b package (pip install e2b) and an E2B account (E2B_API_KEY); "
                "LocalSandbox runs commands on this machine with no account"
            ) from None
        if self.image_metadata_key is None:
            raise RuntimeError(
                "E2BSandbox: set SLIME_AGENT_SANDBOX_IMAGE_METADATA_KEY to the metadata key your E2B "
                "gateway routes images by (SWE_SANDBOX_IMAGE_METADATA_KEY is read too)"
            )
        metadata = {self.image_metadata_key: self.image}
        if self.size:
            prefix = self.image_metadata_key.rsplit("/", 1)[0] if "/" in self.image_metadata_key else ""
            metadata[f"{prefix}/size" if prefix else "size"] = self.size
        self._sb = await self._rpc(
            "create", lambda: AsyncSandbox.create(timeout=self.timeout, metadata=metadata)
        )
        self.sandbox_id = self._sb.sandbox_id
        return self

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._sb is not None:
            try:
                await self._sb.kill()
            except Exception as e:
                logger.warning("[agent.sandbox] killing %s failed: %s", self.sandbox_id[:8], e)

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
        from e2b.sandbox.commands.command_handle import CommandExitException

        try:
            res = await self._rpc(
                f"exec({cmd[:60]!r})",
                lambda: self._sb.commands.run(
                    cmd,
                    user=user,
                    envs=env,
                    timeout=timeout,
                    on_stdout=lambda s: None,
                    on_stderr=lambda s: None,
                ),
                idempotent=idempotent,
            )
            return res.exit_code, res.stdout or "", res.stderr or ""
        except CommandExitException as e:
            if check:
                raise RuntimeError(
                    f"e2b exec failed (exit {e.exit_code}): {cmd[:120]}\n{(e.stderr or '')[:400]}"
                ) from None
            return e.exit_code, e.stdout or "", e.stderr or ""

    async def write_file(self, sandbox_path: str, content: FileContent, *, user: str = "root") -> None:
        if isinstance(content, Path):
            data: Any = content.read_bytes()
        else:
            data = content

        async def write() -> Any:
            payload = io.BytesIO(data) if isinstance(data, bytes) else data
            return await self._sb.files.write(sandbox_path, payload, user=user)

        await self._rpc(f"write_file({sandbox_path})", write)

    async def read_file(self, sandbox_path: str, *, user: str = "root") -> str:
        try:
            return await self._rpc(
                f"read_file({sandbox_path})", lambda: self._sb.files.read(sandbox_path, user=user)
            )
        except Exception:
            return ""
