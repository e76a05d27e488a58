"""An agent RL example: an ordinary OpenAI client program with a python tool, trained through the
agent adapter (docs/agents.md, scripts/run-agent-cpu.sh)."""
