"""The Codex harness (slime's): `codex exec PROMPT` against the OpenAI adapter, the session id as
its API key. The provider's base_url must be in the config file (Codex reads environment
variables for its default provider only), written through base64 to avoid shell quoting. Needs
the Node 22 and Codex npm tarballs on this machine (SLIME_AGENT_NODE_TARBALL,
SLIME_AGENT_CODEX_TARBALL); refused by name where they are missing."""

from __future__ import annotations

import base64
import json
import os
import shlex

from slime.agent.harness.common import BaseHarness, HarnessContext, install_npm_cli, required_file, run_agent
from slime.agent.sandbox import Sandbox


class CodexHarness(BaseHarness):
    name = "codex"
    node_tarball_env = "SLIME_AGENT_NODE_TARBALL"
    cli_tarball_env = "SLIME_AGENT_CODEX_TARBALL"
    extra_args_env = "SLIME_AGENT_CODEX_EXTRA_ARGS"
    extra_envs_env = "SLIME_AGENT_CODEX_EXTRA_ENVS"
    exec_flags = "--skip-git-repo-check"
    config_toml = (
        'model = "{model}"\nmodel_provider = "slime"\n\n[model_providers.slime]\nname = "slime"\n'
        'base_url = "{base_url}"\nenv_key = "OPENAI_API_KEY"\nwire_api = "chat"\n'
    )

    async def install_cli(self, sb: Sandbox) -> None:
        node = required_file(self.node_tarball_env, "Node 22", self.name)
        cli = required_file(self.cli_tarball_env, "the @openai/codex npm package", self.name)
        await install_npm_cli(sb, node_runtime=node, npm_package=cli, check_cmd="codex --version")

    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        toml = self.config_toml.format(model=ctx.model_label, base_url=f"{ctx.adapter_url}/v1")
        encoded = shlex.quote(base64.b64encode(toml.encode()).decode())
        await sb.exec(
            f"mkdir -p /home/agent/.codex && echo {encoded} | base64 -d > /home/agent/.codex/config.toml "
            "&& chown -R agent:agent /home/agent/.codex",
            user="root",
            check=True,
            timeout=60,
        )

    async def launch_and_wait(
        self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: int
    ) -> int:
        cmd = (
            f"codex exec {self.exec_flags} {shlex.quote(prompt)} "
            f"{os.environ.get(self.extra_args_env, '').strip()}"
        )
        env = {
            "OPENAI_API_KEY": ctx.session_id,
            "OPENAI_BASE_URL": f"{ctx.adapter_url}/v1",
            **json.loads(os.environ.get(self.extra_envs_env, "").strip() or "{}"),
        }
        return await run_agent(
            sb, workdir=ctx.workdir, start_cmd=cmd.strip(), env=env, time_budget_sec=time_budget_sec
        )
