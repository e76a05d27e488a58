"""Start a torch engine server as a child process and wait for its ready line."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from dataclasses import dataclass, field


class EngineStartError(RuntimeError):
    pass


@dataclass
class EngineProcess:
    """A running torch engine: its URL and process. `stop()` terminates it."""

    url: str
    proc: subprocess.Popen
    log_path: str | None = None
    args: list[str] = field(default_factory=list)

    def stop(self, timeout_s: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
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
                continue
            if isinstance(event, dict) and event.get("event") == "ready":
                sel.close()
                return EngineProcess(event["url"], proc, log_path, args)
    proc.kill()
    proc.wait()
    raise EngineStartError(f"torch engine not ready after {timeout_s} s; command: {' '.join(args)}")
