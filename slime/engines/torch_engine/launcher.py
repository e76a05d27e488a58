"""Start a torch engine server as a child process and wait for its ready line.

After the ready line a daemon thread keeps reading the child's stdout into the log (the
`log_path` file, else this process's logging): a child whose pipe is never read blocks in its
next write once the pipe buffer (64 KiB on Linux) is full, and stops serving.
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
) -> EngineProcess:
    """Launch `python -m slime.engines.torch_engine` on a free loopback port.

    Args:
        model_path: HF checkpoint directory.
        extra_args: more server flags (e.g. ["--num-threads", "1"]).
        log_path: file for the server's stderr (default: inherit ours).
        timeout_s: how long to wait for the ready line.
    """
    args = [
        sys.executable,
        "-m",
        "slime.engines.torch_engine",
        "--model-path",
        model_path,
        "--port",
        "0",
        *(extra_args or []),
    ]
    stderr = open(log_path, "ab") if log_path else None  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, env={**os.environ, **(env or {})})
    if stderr is not None:
        stderr.close()
    assert proc.stdout is not None
    sink = _OutputSink(log_path, proc.pid)
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
                    target=_forward_stdout,
                    args=(proc, buffer, sink),
                    name=f"engine-{proc.pid}-stdout",
                    daemon=True,
                )
                reader.start()
                return EngineProcess(event["url"], proc, log_path, args, reader)
            sink.write(line + b"\n")
    proc.kill()
    proc.wait()
    raise EngineStartError(f"torch engine not ready after {timeout_s} s; command: {' '.join(args)}")


class _OutputSink:
    """Where the child's stdout goes: appended to `log_path`, else logged line by line."""

    def __init__(self, log_path: str | None, pid: int):
        self.log_path, self.pid = log_path, pid
        self._partial = b""

    def write(self, data: bytes) -> None:
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
        if self._partial:
            self.write(b"\n")


def _forward_stdout(proc: subprocess.Popen, pending: bytes, sink: _OutputSink) -> None:
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
