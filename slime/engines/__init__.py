"""Rollout engines: the SGLang-protocol HTTP client and the built-in torch engine server."""
