"""`slime.debug.breakpoint(rank=0)`: stop one rank of a distributed job in pdb, safely.

A plain `breakpoint()` in sharded training stops one rank; the others run on into the next
collective (an FSDP all-gather in the next forward) and wait there for it. If the stopped rank
then runs a collective of its own from the debugger (printing a DTensor parameter gathers it;
so does a forward), the two sides are in different collectives and the job deadlocks; if the
session lasts longer than the collective timeout, the waiting ranks abort.

Here every rank calls `breakpoint(rank=r)` at the same point (as they would a collective). Rank
r enters pdb at the caller's frame; the others wait on the process group's key-value store,
outside any collective and with no timeout, and say so in their log every minute. Any resume
command (`c`, `n`, `s`, `r`) releases them all together; `q` makes every rank raise
`bdb.BdbQuit`, so the job ends instead of hanging. Inspect freely: a command that needs the
other ranks (a forward, `p param.full_tensor()`) still deadlocks, since they are not in that
collective; that is what `--debug-disable-sharding` (one unsharded rank) is for.

pdb reads the process's stdin (under torchrun, the terminal). A Ray actor has none: there, and
wherever SLIME_PDB_PORT is set, pdb is served on a TCP port and the rank logs `nc HOST PORT` to
attach (SLIME_PDB_HOST, default 127.0.0.1; port 0 picks a free one).
"""

from __future__ import annotations

import bdb
import datetime
import itertools
import logging
import os
import pdb
import socket
import sys
import time
from types import FrameType
from typing import TextIO

logger = logging.getLogger(__name__)

_calls = itertools.count()


class _RankPdb(pdb.Pdb):
    """pdb whose resume commands leave `interaction` (nothing traces the caller afterwards) and
    record whether the user quit."""

    outcome = "continue"

    def __init__(self, stdin: TextIO | None = None, stdout: TextIO | None = None):
        super().__init__(stdin=stdin, stdout=stdout, nosigint=True)
        self.prompt = f"(Pdb rank {_rank()}) "
        self.reset()  # what set_trace would do; interaction() is called directly

    def _leave(self, outcome: str) -> bool:
        self.outcome = outcome
        return True

    def do_continue(self, arg: str) -> bool:
        return self._leave("continue")

    do_c = do_cont = do_next = do_n = do_continue  # type: ignore[assignment]
    do_step = do_s = do_return = do_r = do_continue  # type: ignore[assignment]

    def do_quit(self, arg: str) -> bool:
        return self._leave("quit")

    do_q = do_exit = do_EOF = do_quit  # type: ignore[assignment]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _use_socket() -> bool:
    """A Ray actor has no terminal: serve pdb on a port there, or wherever SLIME_PDB_PORT is set."""
    return "SLIME_PDB_PORT" in os.environ or any("default_worker.py" in a for a in sys.argv[:1])


def _interact(frame: FrameType) -> str:
    """pdb at `frame` until a resume command; returns "continue" or "quit"."""
    if not _use_socket():
        dbg = _RankPdb()
        dbg.interaction(frame, None)
        return dbg.outcome
    host = os.environ.get("SLIME_PDB_HOST", "127.0.0.1")
    with socket.create_server((host, int(os.environ.get("SLIME_PDB_PORT", "0")))) as server:
        port = server.getsockname()[1]
        logger.warning(
            "rank %d stopped in pdb at %s:%d; attach with: nc %s %d",
            _rank(),
            frame.f_code.co_filename,
            frame.f_lineno,
            host,
            port,
        )
        conn, _ = server.accept()
    with conn, conn.makefile("r") as rfile, conn.makefile("w") as wfile:
        dbg = _RankPdb(stdin=rfile, stdout=wfile)
        dbg.interaction(frame, None)
        wfile.flush()
        return dbg.outcome


def breakpoint_at(frame: FrameType, rank: int = 0) -> None:
    """Stop `rank` in pdb at `frame` while every other rank waits outside any collective.

    Every rank must call it at the same point. Without a process group, a plain pdb stop.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        if _interact(frame) == "quit":
            raise bdb.BdbQuit
        return
    me, world = dist.get_rank(), dist.get_world_size()
    if not 0 <= rank < world:
        raise ValueError(f"slime.debug.breakpoint(rank={rank}): the job has ranks 0..{world - 1}")
    key = f"slime/debug/breakpoint/{next(_calls)}"
    store = dist.distributed_c10d._get_default_store()
    if me == rank:
        outcome = "quit"
        try:
            outcome = _interact(frame)
        finally:  # an error in the debugger must not leave the others waiting
            store.set(key, outcome)
    else:
        logger.warning("rank %d waiting at slime.debug.breakpoint while rank %d is in pdb", me, rank)
        start = time.monotonic()
        while True:
            try:
                store.wait([key], datetime.timedelta(seconds=60))
                break
            except Exception:  # the store's timeout: keep waiting, as long as the session lasts
                logger.warning(
                    "rank %d still waiting for rank %d in pdb (%.0f s)", me, rank, time.monotonic() - start
                )
        outcome = store.get(key).decode()
    if outcome == "quit":
        raise bdb.BdbQuit(f"rank {rank} quit the debugger at slime.debug.breakpoint")
