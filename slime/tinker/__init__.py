"""A Tinker-compatible training and sampling service (`python -m slime.tinker`, docs/tinker.md)."""
