"""Run a function on N ranks of a real gloo process group (one fresh process per rank).

The rank processes are forked from a multiprocessing fork server that imported torch,
transformers and megatron-core once for the whole test session: each process still starts
clean (a fork of a server that ran nothing but those imports: no process group, no model, no
thread pool), without paying seconds of imports per rank per test (megatron-core alone takes
about 5 s on this machine, more than most of the tests that use it).
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

PRELOAD = ("torch", "torch.distributed", "transformers", "safetensors.torch", "megatron.core")


def _entry(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    init_method = f"file://{init_file}"
    result = fn(rank, world_size, init_method, *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def _start_method() -> str:
    """forkserver, preloaded with the heavy imports that are installed; spawn on a CUDA machine,
    where the GPU tests were measured with it and CUDA and fork do not mix."""
    if torch.cuda.is_available():
        return "spawn"
    multiprocessing.set_forkserver_preload(
        [m for m in PRELOAD if importlib.util.find_spec(m.split(".")[0]) is not None]
    )
    return "forkserver"


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
            start_method=_start_method(),
        )
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
