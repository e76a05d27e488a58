"""Debugging aids for users: the precision gates (`precision`), and the distributed diagnostics."""
