"""Coding-agent harnesses run in a sandbox (Claude Code, Codex, ...)."""

from slime.agent.harness.claude_code import ClaudeCodeHarness
from slime.agent.harness.codex import CodexHarness
from slime.agent.harness.common import BaseHarness, HarnessContext, run_agent

__all__ = ["BaseHarness", "ClaudeCodeHarness", "CodexHarness", "HarnessContext", "run_agent"]
