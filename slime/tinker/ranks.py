"""`--train-ranks N`: every training model sharded over N FSDP ranks on this machine (one GPU
each with --device cuda). Rank 0 is the server's own training thread; ranks 1..N-1 are worker
processes started with the server, each holding its shard of every model.

Every call on a model runs on all ranks, in the order the training thread issues them: the
FSDP collectives inside (all-gathers in forward, reduce-scatters in backward, the gradient norm,
a checkpoint) need each rank to make the same calls. So nothing a request carries may fail on
one rank only: a request's data is checked on rank 0 before any rank starts
(slime.tinker.trainer.TrainingModel.check). A refusal every rank makes alike (a checkpoint
without optimizer state, the precision gate on the gap the ranks agreed on) leaves them in
step. A failure on some ranks only (a rank's process dying, out of memory on one GPU) does not:
the group is then broken, and every later training call is refused with that failure's message
until the server restarts. A rank that fails inside a collective leaves the others waiting in it
until the process group's timeout (10 minutes; on NCCL its watchdog may end the server).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

logger = logging.getLogger(__name__)

Build = Callable[[int, int], Any]
"""`build(rank, world)` -> this rank's model (a picklable callable: it crosses to the workers)."""


class RankGroup:
    """Rank 0 here, ranks 1..world-1 in worker processes; `call` runs a method on every rank."""

    def __init__(self, world: int):
        self.world = world
        self.broken: str | None = None
        self.models: dict[str, Any] = {}
        """Rank 0's models, by key."""
        self._workers: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads and a group
        for rank in range(1, world):
            here, there = ctx.Pipe()
            proc = ctx.Process(
                target=_serve, args=(rank, world, there), name=f"tinker-rank-{rank}", daemon=True
            )
            proc.start()
            there.close()
            self._workers.append((proc, here))

    def build(self, key: str, build: Build) -> Any:
        """A model on every rank; rank 0's is returned."""
        self._everywhere(("build", key, build), lambda: self.models.setdefault(key, build(0, self.world)))
        return self.models[key]

    def call(self, key: str, method: str, *args: Any) -> list[Any]:
        """`method(*args)` of model `key` on every rank; each rank's result, by rank."""
        return self._everywhere(("call", key, method, args), lambda: getattr(self.models[key], method)(*args))

    def drop(self, key: str) -> None:
        """Forget model `key` on every rank (its memory goes)."""
        self._everywhere(("drop", key), lambda: self.models.pop(key, None))

    def _everywhere(self, command: tuple[Any, ...], here: Callable[[], Any]) -> list[Any]:
        if self.broken is not None:
            raise RanksBroken(self.broken)
        for rank, (proc, conn) in enumerate(self._workers, start=1):
            try:
                conn.send(command)
            except OSError:  # it died since the last call: the ranks sent to are in the call alone
                proc.join(timeout=10)
                self.broken = f"train rank {rank} exited (exit code {proc.exitcode})"
                logger.error("%s", self.broken)
                raise RanksBroken(self.broken) from None
        failures: list[BaseException] = []
        results: list[Any] = [None]
        try:
            results[0] = here()
        except BaseException as e:
            failures.append(e)
        for rank, (proc, conn) in enumerate(self._workers, start=1):
            try:
                status, value = conn.recv()
            except (EOFError, OSError):  # its end of the pipe closed: the process is exiting
                proc.join(timeout=10)
                status, value = "dead", RanksBroken(f"train rank {rank} exited (exit code {proc.exitcode})")
            results.append(value)
            if status != "ok":
                failures.append(value)
        if failures:
            first = failures[0]
            # All ranks refusing alike (a checkpoint without optimizer state, the precision gate)
            # keeps them in step; some failing, or one dying, does not.
            if len(failures) < self.world or any(isinstance(f, RanksBroken) for f in failures):
                self.broken = (
                    f"the train ranks are out of step after a failure: {type(first).__name__}: {first}"
                )
                logger.error("%s", self.broken)
            raise first
        return results

    def close(self) -> None:
        for _, conn in self._workers:
            with contextlib.suppress(OSError):  # (a worker that died)
                conn.send(("close",))
        for proc, _ in self._workers:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


class RanksBroken(RuntimeError):
    """The ranks can no longer run a model's calls together."""


def _serve(rank: int, world: int, conn: Connection) -> None:
    """A worker rank: run the commands rank 0 sends, answer each ("ok", result) or ("error", e)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    models: dict[str, Any] = {}
    while True:
        try:
            command = conn.recv()
        except EOFError:  # the server went away
            return
        if command[0] == "close":
            return
        try:
            if command[0] == "build":
                models[command[1]] = command[2](rank, world)
                result = None
            elif command[0] == "drop":
                models.pop(command[1], None)
                result = None
            else:
                _, key, method, args = command
                result = getattr(models[key], method)(*args)
            conn.send(("ok", result))
        except BaseException as e:
            logger.error("train rank %d: %s", rank, traceback.format_exc())
            try:
                conn.send(("error", e))
            except Exception:  # an exception that does not pickle
                conn.send(("error", RuntimeError(f"train rank {rank}: {type(e).__name__}: {e}")))
