"""Agentic RL (slime's agent layer): adapters an agent program talks to as it would to OpenAI or
Anthropic, the trajectories they record with the engine's exact tokens, sandboxes and harnesses.
See docs/agents.md."""
