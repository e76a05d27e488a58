"""A coding agent's lifecycle in a sandbox (slime's): a harness installs its CLI, writes its
config and runs the agent on a prompt against an adapter's URL, with the session id as its API
key. Task preparation and scoring are the caller's.

`BaseHarness.run`: the agent user (sandboxes of several users), `write_config`,
`launch_and_wait`. `run_agent` runs a start command detached to completion (exec_and_wait),
its output in <workdir>/.harness/trajectory.jsonl. `install_npm_cli` / `install_node22` install
an npm-packaged CLI from tarballs on this machine (the sandbox needs no network for it).
"""

from __future__ import annotations

import asyncio
import lzma
import os
import shutil
import tempfile
from abc import ABC, ABCMeta, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from slime.agent import sandbox as _sandbox
from slime.agent.sandbox import Sandbox, exec_and_wait
from slime.utils.misc import SingletonMeta

NPM_INSTALL_RETRIES = 3
NPM_INSTALL_BACKOFF_SEC = 2.0


class SingletonABCMeta(ABCMeta, SingletonMeta):
    pass


@dataclass(frozen=True)
class HarnessContext:
    """What a run needs, free of any task: the workdir, the session id (the agent's API key),
    the adapter's URL, and the model name the CLI is told (the adapter serves the engine's)."""

    workdir: str
    session_id: str
    adapter_url: str
    model_label: str = "slime-actor"


class BaseHarness(ABC, metaclass=SingletonABCMeta):
    """A sandbox-resident agent CLI; one instance per process (slime's)."""

    name: str = ""

    @abstractmethod
    async def install_cli(self, sb: Sandbox) -> None:
        """Install the CLI into the sandbox."""

    @abstractmethod
    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        """Write the CLI's config files into the sandbox."""

    @abstractmethod
    async def launch_and_wait(
        self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: int
    ) -> int:
        """Run the agent to completion: its exit code (EXIT_TIME_BUDGET_EXCEEDED past the budget)."""

    async def run(
        self,
        sb: Sandbox,
        *,
        workdir: str,
        session_id: str,
        adapter_url: str,
        time_budget_sec: int,
        prompt: str,
    ) -> int:
        """The agent user, the config, the run: the agent's exit code. The workspace must be
        prepared before."""
        await _sandbox.ensure_agent_user(sb, workdir)
        ctx = HarnessContext(workdir=workdir, session_id=session_id, adapter_url=adapter_url)
        await self.write_config(sb, ctx)
        return await self.launch_and_wait(sb, ctx, prompt, time_budget_sec)


async def run_agent(
    sb: Sandbox, *, workdir: str, start_cmd: str, env: dict[str, str], time_budget_sec: int
) -> int:
    """Run `start_cmd` as the agent user in `workdir`, detached, to completion: its exit code."""
    meta = f"{workdir}/.harness"
    own = "" if getattr(sb, "single_user", False) else f" && chown agent:agent {meta}"
    await sb.exec(f"mkdir -p {meta}{own}", user="root", check=True, timeout=30)
    code, _ = await exec_and_wait(
        sb,
        cmd=start_cmd,
        user="agent",
        env=env,
        workdir=workdir,
        out_file=f"{meta}/trajectory.jsonl",
        time_budget_sec=time_budget_sec,
        tag="run",
    )
    return code


def required_file(env_name: str, what: str, harness: str) -> Path:
    """The file environment variable `env_name` names; RuntimeError naming it when unset or
    missing (a harness whose CLI cannot be installed is refused before a sandbox is made)."""
    value = os.environ.get(env_name, "").strip()
    if not value or not os.path.isfile(value):
        state = "is not set" if not value else f"names {value!r}, which does not exist"
        raise RuntimeError(
            f"the {harness} harness installs {what} from a tarball on this machine: {env_name} {state}"
        )
    return Path(value)


async def install_npm_cli(sb: Sandbox, *, node_runtime: Path, npm_package: Path, check_cmd: str) -> None:
    """Node 22, then the CLI's npm package installed globally and checked with `check_cmd`,
    retried in place on a failed install."""
    await install_node22(sb, node_runtime)
    await sb.write_file("/tmp/harness-cli.tgz", npm_package)
    command = f"npm install -g --prefix=/usr/local --no-audit --no-fund /tmp/harness-cli.tgz && {check_cmd}"
    code, log = 0, ""
    for attempt in range(NPM_INSTALL_RETRIES):
        code, log = await exec_and_wait(
            sb, cmd=command, user="root", time_budget_sec=300, tag="harness-npm-install"
        )
        if code == 0:
            return
        if attempt + 1 < NPM_INSTALL_RETRIES:
            await asyncio.sleep(NPM_INSTALL_BACKOFF_SEC * (attempt + 1))
    raise RuntimeError(
        f"npm install failed after {NPM_INSTALL_RETRIES} attempts (exit {code}):\n{log[-1000:]}"
    )


async def install_node22(sb: Sandbox, host_tarball: Path) -> None:
    """Node 22 from a tarball on this machine (a .xz one is decompressed here once, cached, for
    sandboxes without xz)."""
    host_tarball = Path(host_tarball)
    if host_tarball.suffix == ".xz":
        plain = Path(tempfile.gettempdir()) / f"slime-agent.{host_tarball.stem}"
        if not plain.exists():
            partial = plain.with_name(plain.name + ".partial")
            with lzma.open(host_tarball, "rb") as src, open(partial, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(partial, plain)
        host_tarball = plain
    await sb.write_file("/tmp/node22.tar", host_tarball)
    await sb.exec(
        "set -e && mkdir -p /opt/node22 && tar xf /tmp/node22.tar -C /opt/node22 --strip-components=1 && "
        "for b in node npm npx; do ln -sf /opt/node22/bin/$b /usr/local/bin/$b; done && node --version && "
        "npm --version",
        user="root",
        timeout=180,
        check=True,
    )
