"""The sglang-router in front of the engines (`--rollout-backend sglang`).

The rollout manager starts one (`python -m sglang_router.launch_router`, the sglang-router
package) unless `--sglang-router-ip/--sglang-router-port` name a router that already runs, and
registers every engine slime uses with it; a restarted engine replaces the old worker. slime's own
generation talks to each engine directly (it places groups itself and must know which engine a
group ran on to generate it again when that engine goes down); the router is the one address
that custom rollout and generate functions post to (`args.sglang_router_ip`, as in slime).

With the engines' API key (`api_key`), the router requires `Authorization: Bearer <key>` on its
own routes but /health (sglang-router's `--api-key`, which reaches the router in its environment,
not on its command line) and forwards each client's header to the engine it picks, so one key
opens both. Workers are registered without a key of their own: sglang-router 0.3 would add that
key to every request it forwards, turning the router into an open door to the engines for
anyone who can reach it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from slime.engines.protocol import API_KEY_ENV, check_api_key
from slime.utils.errors import UsageError
from slime.utils.net import free_port

logger = logging.getLogger(__name__)


class RouterError(RuntimeError):
    pass


class RouterUnreachable(UsageError):
    """--sglang-router-ip/--sglang-router-port name an address where no router answers."""


# sglang-router's own launcher, with the API key taken from the environment instead of argv.
_LAUNCH_WITH_KEY = (
    "import os, sys\n"
    "from sglang_router.launch_router import launch_router, parse_router_args\n"
    "args = parse_router_args(sys.argv[1:])\n"
    f"args.api_key = os.environ.pop({API_KEY_ENV!r})\n"
    "launch_router(args)\n"
)


class Router:
    """A router at `url`; `proc` is set when slime started it (and stops it). `api_key`: the
    key its requests carry (the engines' key)."""

    def __init__(
        self,
        host: str,
        port: int,
        proc: subprocess.Popen | None = None,
        log_path: str | None = None,
        api_key: str | None = None,
    ):
        self.host, self.port, self.proc, self.log_path = host, port, proc, log_path
        self.url = f"http://{host}:{port}"
        if api_key is not None:
            check_api_key(api_key)
        self._api_key = api_key

    def __repr__(self) -> str:
        return (
            f"Router({self.url!r}, started={self.proc is not None}, "
            f"api_key={'set' if self._api_key else None})"
        )

    @classmethod
    def start(
        cls,
        host: str,
        log_path: str,
        timeout_s: float = 60.0,
        api_key: str | None = None,
        port: int | None = None,
    ) -> Router:
        """Start a router with no workers on `port` (None: a free port) of `host` and wait until
        it answers; with `api_key`, it requires that key (see the module docstring)."""
        try:
            import sglang_router  # noqa: F401 - only to fail early with an install hint
        except ImportError as e:
            raise RouterError(
                "--rollout-backend sglang starts an sglang-router, which is not installed (pip install "
                "sglang-router), or give a running one with --sglang-router-ip/--sglang-router-port"
            ) from e
        port = port or free_port(host)
        # Its Prometheus exporter would bind 0.0.0.0:29000: every interface, and one router per
        # machine (a second job's router died on the port). Beside the router, on a free port.
        metrics_port = free_port(host)
        options = ["--host", host, "--port", str(port)]
        options += ["--prometheus-host", host, "--prometheus-port", str(metrics_port)]
        env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        if api_key is None:
            argv = [sys.executable, "-m", "sglang_router.launch_router", *options]
        else:
            check_api_key(api_key)
            argv = [sys.executable, "-c", _LAUNCH_WITH_KEY, *options]
            env[API_KEY_ENV] = api_key
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        router = cls(host, port, proc, log_path, api_key)
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RouterError(f"the sglang-router exited with code {proc.returncode}; see {log_path}")
            try:
                router.workers()
                logger.info(
                    "sglang-router at %s; its Prometheus metrics at http://%s:%d/metrics (no key)",
                    router.url,
                    host,
                    metrics_port,
                )
                return router
            except (OSError, RouterError):
                if time.monotonic() > deadline:
                    router.stop()
                    raise RouterError(
                        f"the sglang-router did not answer within {timeout_s:.0f} s; see {log_path}"
                    ) from None
                time.sleep(0.3)

    def _call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if self._api_key:
            req.add_header("Authorization", f"Bearer {self._api_key}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw) if raw else None
        except json.JSONDecodeError:
            return status, raw.decode(errors="replace")

    @classmethod
    def running(
        cls, host: str, port: int, api_key: str | None = None
    ) -> tuple[Router, dict[str, str | None]]:
        """The router the user started at --sglang-router-ip/--sglang-router-port and its workers;
        RouterUnreachable (a usage error) when nothing answers there."""
        router = cls(host, port, api_key=api_key)
        try:
            return router, router.workers()
        except OSError as e:
            raise RouterUnreachable(
                f"--sglang-router-ip/--sglang-router-port: no sglang-router answers at {router.url} ({e}); "
                "start it first or fix the address"
            ) from None

    def workers(self) -> dict[str, str | None]:
        """Registered worker URL -> the router's id for it (None on routers without ids)."""
        status, answer = self._call("GET", "/workers")
        if status == 404:  # routers before the /workers API
            status, answer = self._call("GET", "/list_workers")
        if status != 200:
            raise RouterError(f"router {self.url}: listing workers answered {status}: {answer}")
        return _workers(answer)

    def add_worker(self, worker_url: str, timeout_s: float = 120.0) -> None:
        """Register `worker_url` and wait until the router lists it (sglang-router >= 0.3 adds
        workers in the background, after its own /health check of the worker)."""
        status, answer = self._call("POST", "/workers", {"url": worker_url})
        if status in (404, 405):  # routers before the /workers API
            status, answer = self._call("POST", "/add_worker?url=" + urllib.parse.quote(worker_url, safe=""))
        if status not in (200, 201, 202):
            raise RouterError(f"router {self.url} refused worker {worker_url} ({status}): {answer}")
        if not self._wait_listed(worker_url, True, timeout_s):
            raise RouterError(
                f"router {self.url} accepted worker {worker_url} but did not list it within "
                f"{timeout_s:.0f} s (its health check of the worker fails?); see "
                f"{self.log_path or 'the router log'}"
            )

    def _wait_listed(self, worker_url: str, listed: bool, timeout_s: float) -> bool:
        """Poll until the router lists `worker_url` (listed=True) or no longer does; False on timeout.
        sglang-router >= 0.3 adds and removes workers in the background."""
        deadline = time.monotonic() + timeout_s
        while (worker_url in self.workers()) != listed:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def remove_worker(self, worker_url: str, timeout_s: float = 30.0) -> None:
        """Unregister `worker_url` and wait until the router no longer lists it (sglang-router
        >= 0.3 answers 202 and removes it in the background); a warning, not an error, when the
        router refuses or keeps listing it."""
        listed = self.workers()
        if worker_url not in listed:
            return
        worker_id = listed[worker_url]
        if worker_id is not None:
            status, answer = self._call("DELETE", "/workers/" + urllib.parse.quote(worker_id, safe=""))
        else:
            status, answer = self._call(
                "POST", "/remove_worker?url=" + urllib.parse.quote(worker_url, safe="")
            )
        if status not in (200, 202, 204):
            logger.warning(
                "router %s: removing worker %s answered %s: %s", self.url, worker_url, status, answer
            )
            return
        if not self._wait_listed(worker_url, False, timeout_s):
            logger.warning(
                "router %s still lists worker %s %.0f s after removing it", self.url, worker_url, timeout_s
            )

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _workers(answer: Any) -> dict[str, str | None]:
    """A router's worker listing: `{"workers": [{"id", "url", ...}]}` (sglang-router >= 0.3) or
    `{"urls": [...]}` (older)."""
    if isinstance(answer, dict) and isinstance(answer.get("urls"), list):
        return {str(u): None for u in answer["urls"]}
    if isinstance(answer, dict) and isinstance(answer.get("workers"), list):
        return {
            (w["url"] if isinstance(w, dict) else str(w)): (w.get("id") if isinstance(w, dict) else None)
            for w in answer["workers"]
        }
    raise RouterError(f"unexpected worker listing: {answer!r}")
