"""Start one SGLang HTTP server (`python -m sglang.launch_server`) and wait until it generates.

Used by the Ray engine actor of `--rollout-backend sglang` (slime.ray.actors.SGLangEngineActor):
the actor runs on the first Ray bundle of its engine and starts the server as a child process
that sees exactly the engine's GPUs (`CUDA_VISIBLE_DEVICES`), with `--tp-size` from
`--rollout-num-gpus-per-engine` and free ports on the actor's node. Readiness is a real
one-token generation (`GET /health_generate` answers 200), not only an open port; a server
that exits first, or is not ready within the timeout, is an error that quotes the end of its log.

With an API key (`SGLangLaunch.api_key`) the server requires `Authorization: Bearer <key>` on
every route but /health* (SGLang's `--api-key`). SGLang reads its options from no environment
variable, so the key goes in a YAML file given as `--config` (SGLang's own flag; the file is
private to this user and removed once the server is ready), not on the command line, which every
user of the machine can read. SGLang logs its whole configuration at start-up, key included, so
with a key its output reaches the log through this process, which replaces the key by ***.

SGLang itself is never imported here: the server is another process, so `import slime` works
without SGLang.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from slime.engines.protocol import check_api_key
from slime.engines.torch_engine.launcher import EngineProcess, EngineStartError, OutputSink, forward_output


@dataclass(frozen=True)
class SGLangLaunch:
    """What one SGLang server is started with (the rest comes from `--sglang-*` flags)."""

    model_path: str
    tp_size: int
    host: str
    port: int
    nccl_port: int
    seed: int
    deterministic: bool = False
    memory_saver: bool = False  # --colocate: release/resume memory needs SGLang's memory saver
    weight_version: str = "0"
    extra_args: tuple[str, ...] = ()
    api_key: str | None = field(default=None, repr=False)
    """Required on every route but /health*; passed in a --config file, never on the command line."""

    def __post_init__(self) -> None:
        if self.api_key is not None:
            check_api_key(self.api_key)
            if any(
                a in ("--config", "--api-key") or a.startswith(("--config=", "--api-key="))
                for a in self.extra_args
            ):
                raise ValueError(
                    "slime passes the API key to SGLang in its own --config file: drop --sglang-config / "
                    "--sglang-api-key (one config file per server; the key never goes on a command line)"
                )

    def command(self) -> list[str]:
        argv = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--tp-size",
            str(self.tp_size),
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--nccl-port",
            str(self.nccl_port),
            "--random-seed",
            str(self.seed),
            "--weight-version",
            self.weight_version,
        ]
        if self.deterministic:
            argv.append("--enable-deterministic-inference")
        if self.memory_saver:
            argv.append("--enable-memory-saver")
        return [*argv, *self.extra_args]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"


class SGLangProcess(EngineProcess):
    """A server and every process it started (its process group): SIGTERM, then SIGKILL."""

    def trace_events(self, timeout_s: float = 60.0) -> list[dict]:
        """SGLang records nothing for the job's timeline (its own tracing is OpenTelemetry's)."""
        return []

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=timeout_s)
        _signal_group(self.proc.pid, signal.SIGKILL)  # whatever of the group is still there
        self.proc.wait()
        if self.stdout_reader is not None:
            self.stdout_reader.join(timeout=5)
        return self.proc.returncode


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)


def start_sglang_server(
    launch: SGLangLaunch,
    gpu_ids: list[str] | None,
    log_path: str,
    timeout_s: float = 900.0,
    env: dict[str, str] | None = None,
) -> EngineProcess:
    """Start the server and return once `/health_generate` answers 200.

    Args:
        launch: the command line's settings.
        gpu_ids: the devices the server may use (its `CUDA_VISIBLE_DEVICES`); None leaves the
            variable as it is (CPU test runs).
        log_path: the server's stdout and stderr go here (appended).
        timeout_s: how long loading and warm-up may take.
    """
    child_env = {**os.environ, **(env or {})}
    if gpu_ids is not None:
        child_env["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    argv = launch.command()
    config_path = _write_key_config(launch.api_key) if launch.api_key else None
    if config_path is not None:
        argv += ["--config", config_path]
    try:
        server = _spawn(launch, argv, child_env, log_path)
        _wait_ready(server, launch, timeout_s)
        return server
    finally:
        if config_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(config_path)


def _write_key_config(api_key: str) -> str:
    """A YAML file only this user can read (mkstemp: mode 0600) holding SGLang's api-key option."""
    fd, path = tempfile.mkstemp(prefix="slime-sglang-", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        f.write(f"api-key: {json.dumps(api_key)}\n")  # a JSON string is a YAML string
    return path


def _spawn(launch: SGLangLaunch, argv: list[str], env: dict[str, str], log_path: str) -> SGLangProcess:
    """Start the server in its own process group (SGLang's scheduler and detokenizer processes go
    with it on stop); its output goes to `log_path`, through a key-scrubbing thread with a key."""
    with open(log_path, "ab") as log:
        log.write(f"$ {' '.join(argv)}\n".encode())
        log.flush()
        out = subprocess.PIPE if launch.api_key else log
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    reader = None
    if launch.api_key:
        sink = OutputSink(log_path, proc.pid, launch.api_key)
        reader = threading.Thread(
            target=forward_output, args=(proc, b"", sink), name=f"sglang-{proc.pid}-output", daemon=True
        )
        reader.start()
    return SGLangProcess(launch.url, proc, log_path, argv, reader, launch.api_key)


def _wait_ready(server: SGLangProcess, launch: SGLangLaunch, timeout_s: float) -> None:
    proc, log_path, argv = server.proc, server.log_path or "", server.args
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while True:
        code = proc.poll()
        if code is not None:
            if server.stdout_reader is not None:
                server.stdout_reader.join(timeout=5)  # the end of its output, for the message
            raise EngineStartError(
                f"the SGLang server exited with code {code} before it was ready; the end of {log_path}:\n"
                f"{_tail(log_path)}\ncommand: {' '.join(argv)}"
            )
        last = _probe(launch.url + "/health_generate", launch.api_key)
        if last == "ok":
            return
        if time.monotonic() > deadline:
            server.stop()
            raise EngineStartError(
                f"the SGLang server at {launch.url} did not pass /health_generate within {timeout_s:.0f} s "
                f"(last: {last}); the end of {log_path}:\n{_tail(log_path)}"
            )
        time.sleep(1.0)


def _probe(url: str, api_key: str | None = None) -> str:
    # SGLang leaves /health* open; the key is sent anyway, for servers that do not.
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as resp:
            return "ok" if resp.status == 200 else f"HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (OSError, ValueError) as e:  # not listening yet, reset, timeout
        return f"{type(e).__name__}: {e}"


def _tail(path: str, num_bytes: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.path.getsize(path) - num_bytes))
            return f.read().decode(errors="replace")
    except OSError as e:
        return f"(cannot read the log: {e})"
