"""Handing device memory back to the driver (colocation: the rollout engine needs every byte)."""

from __future__ import annotations

import gc

import torch


def release_device_memory() -> None:
    """Return every unused byte of this process's CUDA memory to the driver: wait for the
    device, collect Python garbage, drop cuBLAS's workspaces, empty the caching allocator. A
    no-op where CUDA was never initialised (nothing to release)."""
    if not torch.cuda.is_initialized():
        return
    # Pending kernels may still read blocks that are about to be freed; tensors caught in
    # reference cycles (autograd graphs, closures) are only freed by the collector.
    torch.cuda.synchronize()
    gc.collect()
    # cuBLAS keeps a workspace per handle and stream (32 MiB each on Hopper; 64 MiB in all after a
    # forward and backward on an H200) in the caching allocator, where empty_cache cannot free it.
    # This private function drops them (the cuBLASLt ones too in recent torch; torch has no
    # separate one for those): some builds lack it, and then only empty_cache runs.
    clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear_workspaces is not None:
        clear_workspaces()
    torch.cuda.empty_cache()


def cuda_memory_held(device: torch.device) -> dict[str, int]:
    """What this process holds on `device` through the caching allocator (bytes; {} off CUDA):
    a colocated trainer needs it near 0 after an engine released its memory."""
    if device.type != "cuda":
        return {}
    return {
        "cuda_memory_allocated": torch.cuda.memory_allocated(device),
        "cuda_memory_reserved": torch.cuda.memory_reserved(device),
    }
