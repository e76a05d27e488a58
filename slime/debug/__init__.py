"""Debugging aids for users: the precision gates (`precision`), and the distributed diagnostics."""


def breakpoint(rank: int = 0) -> None:
    """Stop `rank` in pdb at the caller while the other ranks wait outside any collective
    (slime.debug.rank_pdb explains)."""
    import sys

    from slime.debug import rank_pdb

    # Report the caller's frame, not this wrapper's.
    rank_pdb.breakpoint_at(sys._getframe(1), rank)
