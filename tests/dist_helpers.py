"""Run a function on N ranks of a real gloo process group (one spawned process per rank)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    init_method = f"file://{init_file}"
    result = fn(rank, world_size, init_method, *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(world_size: int, fn: Callable, *args: Any) -> list[Any]:
    """Call fn(rank, world_size, init_method, *args) on every rank; return the results by rank.

    `fn` must be importable (module level). A failing rank raises here with its traceback.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        mp.start_processes(
            _entry,
            args=(world_size, init_file, tmp, fn, args),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
