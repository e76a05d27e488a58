"""Start a torch engine server as a child process and wait for its ready line.

After the ready line a daemon thread keeps reading the child's stdout into the log (the
`log_path` file, else this process's logging): a child whose pipe is never read blocks in its
next write once the pipe buffer (64 KiB on Linux) is full, and stops serving.

An API key reaches the child in its environment (SLIME_ENGINE_API_KEY), never on its command
line, which every user of the machine can read; the forwarded output is scrubbed of it too.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

from slime.engines.protocol import API_KEY_ENV, check_api_key

logger = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    pass


@dataclass
class EngineProcess:
    """A running torch engine: its URL and process. `stop()` terminates it."""

    url: str
    proc: subprocess.Popen
    log_path: str | None = None
    args: list[str] = field(default_factory=list)
    stdout_reader: threading.Thread | None = None
    api_key: str | None = field(default=None, repr=False)
    """The key clients must send (slime.engines.client.ClientConfig.api_key); None: no key."""

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.stdout_reader is not None:
            self.stdout_reader.join(timeout=5)  # EOF follows the exit, unless a grandchild holds the pipe
        return self.proc.returncode

    def trace_events(self, timeout_s: float = 60.0) -> list[dict]:
        """The server's events for the job's timeline since the last call (GET
        /slime/trace_events; slime.utils.job_trace): none unless it records."""
        import urllib.request

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        request = urllib.request.Request(self.url + "/slime/trace_events", headers=headers)
        direct = urllib.request.build_opener(
            urllib.request.ProxyHandler({})
        )  # the key goes to the engine only
        with direct.open(request, timeout=timeout_s) as answer:
            return list(json.load(answer)["events"])

    def __enter__(self) -> EngineProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_torch_engine(
    model_path: str,
    extra_args: list[str] | None = None,
    log_path: str | None = None,
    timeout_s: float = 180.0,
    env: dict[str, str] | None = None,
    *,
    api_key: str | None = None,
    debug_dump_dir: str | None = None,
) -> EngineProcess:
    """Launch `python -m slime.engines.torch_engine` on a free port (loopback unless
    `extra_args` has `--host`).

    Args:
        model_path: HF checkpoint directory.
        extra_args: more server flags (e.g. ["--num-threads", "1"]); not `--api-key`.
        log_path: file for the server's stderr (default: inherit ours).
        timeout_s: how long to wait for the ready line (at least 600 s with
            --enable-torch-compile: the decode step compiles before it).
        env: more environment variables for the child.
        api_key: the key every route but /health* will require, passed in the child's
            environment; None: no key (an SLIME_ENGINE_API_KEY of ours is not inherited).
        debug_dump_dir: `--debug-dump-dir`, the one directory /slime/dump_parameters may write
            under (made absolute here, against our working directory); None: dumps refused.
    """
    extra = list(extra_args or [])
    if "--enable-torch-compile" in extra:
        timeout_s = max(timeout_s, 600.0)
    if any(a == "--api-key" or a.startswith("--api-key=") for a in extra):
        raise ValueError(
            "pass the API key as start_torch_engine(api_key=...), not as --api-key in extra_args: "
            "a command line is readable by every user of the machine"
        )
    if api_key is not None:
        check_api_key(api_key)
    if debug_dump_dir is not None:
        extra += ["--debug-dump-dir", os.path.abspath(debug_dump_dir)]
    child_env = {**os.environ, **(env or {})}
    child_env.pop(API_KEY_ENV, None)
    if api_key is not None:
        child_env[API_KEY_ENV] = api_key
    args = [
        sys.executable,
        "-m",
        "slime.engines.torch_engine",
        "--model-path",
        model_path,
        "--port",
        "0",
        *extra,
    ]
    stderr = open(log_path, "ab") if log_path else None  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, env=child_env)
    if stderr is not None:
        stderr.close()
    return _wait_ready(proc, args, log_path, timeout_s, api_key)


def _wait_ready(
    proc: subprocess.Popen[bytes],
    args: list[str],
    log_path: str | None,
    timeout_s: float,
    api_key: str | None,
) -> EngineProcess:
    """Read the child's stdout until its `{"event": "ready", "url": ...}` line (what came before
    goes to the log), then hand the rest to a forwarding thread; EngineStartError if it exits or
    stays silent for `timeout_s`."""
    assert proc.stdout is not None
    sink = OutputSink(log_path, proc.pid, api_key)
    deadline = time.monotonic() + timeout_s
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    buffer = b""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EngineStartError(
                f"torch engine exited with code {proc.returncode} before it was ready "
                f"(see {log_path or 'stderr'}); command: {' '.join(args)}"
            )
        if not sel.select(timeout=0.2):
            continue
        chunk = os.read(proc.stdout.fileno(), 4096)
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                event = None
            if isinstance(event, dict) and event.get("event") == "ready":
                sel.close()
                reader = threading.Thread(
                    target=forward_output,
                    args=(proc, buffer, sink),
                    name=f"engine-{proc.pid}-stdout",
                    daemon=True,
                )
                reader.start()
                return EngineProcess(event["url"], proc, log_path, args, reader, api_key)
            sink.write(line + b"\n")
    proc.kill()
    proc.wait()
    raise EngineStartError(f"torch engine not ready after {timeout_s} s; command: {' '.join(args)}")


class OutputSink:
    """Where a child's output goes: appended to `log_path`, else logged line by line; every
    occurrence of `secret` is replaced by *** first (also one split across two writes)."""

    def __init__(self, log_path: str | None, pid: int, secret: str | None = None):
        self.log_path, self.pid = log_path, pid
        self._partial = b""
        self._secret = secret.encode() if secret else b""
        self._held = b""  # a tail that may be the start of the secret

    def write(self, data: bytes) -> None:
        if self._secret:
            data = (self._held + data).replace(self._secret, b"***")
            keep = next(
                (
                    k
                    for k in range(min(len(self._secret) - 1, len(data)), 0, -1)
                    if data.endswith(self._secret[:k])
                ),
                0,
            )
            data, self._held = data[: len(data) - keep], data[len(data) - keep :]
        self._emit(data)

    def _emit(self, data: bytes) -> None:
        if not data:
            return
        if self.log_path:
            # O_APPEND: safe next to the child's own stderr writes to the same file.
            with open(self.log_path, "ab") as f:
                f.write(data)
            return
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            logger.info("engine pid=%d stdout: %s", self.pid, line.decode(errors="replace"))

    def close(self) -> None:
        held, self._held = self._held, b""
        self._emit(held)
        if self._partial:
            self._emit(b"\n")


def forward_output(proc: subprocess.Popen, pending: bytes, sink: OutputSink) -> None:
    """Read the child's stdout until EOF, so its writes never block on a full pipe."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    try:
        if pending:
            sink.write(pending)
        while chunk := os.read(fd, 65536):
            sink.write(chunk)
    except OSError as e:
        logger.warning("reading the stdout of engine pid=%d failed: %s", proc.pid, e)
    finally:
        sink.close()
        proc.stdout.close()
