"""The Claude Code harness (slime's): `claude -p PROMPT` against the Anthropic adapter, the
session id as its auth token. Needs the Node 22 and Claude Code npm tarballs on this machine
(SLIME_AGENT_NODE_TARBALL, SLIME_AGENT_CC_TARBALL); refused by name where they are missing."""

from __future__ import annotations

import json
import os
import shlex
from typing import ClassVar

from slime.agent.harness.common import BaseHarness, HarnessContext, install_npm_cli, required_file, run_agent
from slime.agent.sandbox import Sandbox


class ClaudeCodeHarness(BaseHarness):
    name = "claude_code"
    node_tarball_env = "SLIME_AGENT_NODE_TARBALL"
    cli_tarball_env = "SLIME_AGENT_CC_TARBALL"
    extra_args_env = "SLIME_AGENT_CC_EXTRA_ARGS"
    extra_envs_env = "SLIME_AGENT_CC_EXTRA_ENVS"
    launch_flags = (
        "--permission-mode bypassPermissions --output-format stream-json --include-partial-messages "
        "--include-hook-events --verbose"
    )
    static_env: ClassVar[dict[str, str]] = {
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_DISABLE_EXPERIMENTAL_BETAS": "1",
        "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
    }

    async def install_cli(self, sb: Sandbox) -> None:
        node = required_file(self.node_tarball_env, "Node 22", self.name)
        cli = required_file(self.cli_tarball_env, "the @anthropic-ai/claude-code npm package", self.name)
        await install_npm_cli(
            sb,
            node_runtime=node,
            npm_package=cli,
            check_cmd="ls -la /usr/local/bin/claude && /usr/local/bin/claude --version",
        )

    async def write_config(self, sb: Sandbox, ctx: HarnessContext) -> None:
        """Onboarding and bypass-permissions acknowledged, so the CLI starts headless."""
        settings = shlex.quote(
            json.dumps({"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True})
        )
        await sb.exec(
            f"mkdir -p /home/agent/.claude && echo {settings} | tee /home/agent/.claude.json "
            "/home/agent/.claude/settings.json > /dev/null && chown -R agent:agent /home/agent/.claude "
            "/home/agent/.claude.json",
            user="root",
            check=True,
            timeout=60,
        )

    async def launch_and_wait(
        self, sb: Sandbox, ctx: HarnessContext, prompt: str, time_budget_sec: int
    ) -> int:
        cmd = f"/usr/local/bin/claude -p {shlex.quote(prompt)} {self.launch_flags}"
        extra = os.environ.get(self.extra_args_env, "").strip()
        env = {
            "ANTHROPIC_BASE_URL": ctx.adapter_url,
            "ANTHROPIC_AUTH_TOKEN": ctx.session_id,
            "ANTHROPIC_MODEL": ctx.model_label,
            **self.static_env,
            **json.loads(os.environ.get(self.extra_envs_env, "").strip() or "{}"),
        }
        return await run_agent(
            sb,
            workdir=ctx.workdir,
            start_cmd=f"{cmd} {extra}".strip(),
            env=env,
            time_budget_sec=time_budget_sec,
        )
