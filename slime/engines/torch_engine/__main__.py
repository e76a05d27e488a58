"""`python -m slime.engines.torch_engine`: start the torch engine server."""

from slime.engines.torch_engine.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
