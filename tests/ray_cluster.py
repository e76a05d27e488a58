"""Ray clusters started the way users start them (`ray start`), for jobs that attach with RAY_ADDRESS.

Each cluster has its own --temp-dir and is stopped by the pids of the processes started under
it (not `ray stop`, which would stop every cluster on the machine)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from slime.utils.net import free_port


def _ray_command() -> list[str]:
    """The `ray` command of this Python: its console script, or (where Ray was unpacked without
    one, as on the offline GPU machine) the function that script calls."""
    script = os.path.join(os.path.dirname(sys.executable), "ray")
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]


RAY = _ray_command()
# Ray rewrites a node address of 127.0.0.1 (or localhost) to the machine's network address; any
# other loopback address it keeps, so the head takes 127.0.0.3.
HEAD_IP = "127.0.0.3"


class RayCluster:
    """A head node on HEAD_IP and, optionally, more nodes on other loopback addresses."""

    def __init__(self, head_cpus: int, nodes: dict[str, int] | None = None):
        # A short path: Ray's socket paths must fit in 107 bytes.
        self.temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
        port = free_port(HEAD_IP)
        self.address = f"{HEAD_IP}:{port}"
        try:
            self._start(
                "--head",
                "--node-ip-address",
                HEAD_IP,
                "--port",
                str(port),
                "--num-cpus",
                str(head_cpus),
                "--include-dashboard",
                "false",
            )
            for ip, cpus in (nodes or {}).items():
                self._start("--address", self.address, "--node-ip-address", ip, "--num-cpus", str(cpus))
            self._wait_for(1 + len(nodes or {}))
        except BaseException:
            self.stop()
            raise

    def _start(self, *args: str) -> None:
        subprocess.run(
            [*RAY, "start", *args, "--temp-dir", self.temp_dir, "--disable-usage-stats"],
            env=self.env,
            check=True,
            capture_output=True,
            timeout=120,
        )

    def _wait_for(self, num_nodes: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        probe = "import ray; ray.init(); print(sum(n['Alive'] for n in ray.nodes()))"
        while True:
            out = subprocess.run(
                [sys.executable, "-c", probe],
                env={**self.env, "RAY_ADDRESS": self.address},
                capture_output=True,
                text=True,
                timeout=120,
            )
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1] == str(num_nodes):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the Ray cluster did not reach {num_nodes} nodes: {out.stdout} {out.stderr}"
                )
            time.sleep(1)

    def pids(self) -> list[int]:
        """Every process started under this cluster's temp dir, and the Ray client server that
        the head starts, whose command line names only the cluster's address."""
        marks = (self.temp_dir.encode(), f"--address={self.address}\0".encode())
        found = []
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = f.read()
                if any(mark in cmdline for mark in marks):
                    found.append(int(pid))
            except OSError:
                continue
        return found

    def stop(self) -> None:
        # Ray's gcs_server and raylets can take over 10 s to act on SIGTERM; a test cluster holds
        # nothing worth that wait.
        for sig, grace_s in ((signal.SIGTERM, 2), (signal.SIGKILL, 10)):
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + grace_s
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


_shared: RayCluster | None = None


def shared_address() -> str:
    """The address of one single-node cluster that the end-to-end jobs of a test session share
    (started at the first call, stopped by conftest at the end of the session): each job attaches
    instead of starting and stopping a Ray of its own."""
    global _shared
    if _shared is None:
        _shared = RayCluster(head_cpus=8)
    return _shared.address


def stop_shared() -> None:
    global _shared
    if _shared is not None:
        _shared.stop()
        _shared = None
