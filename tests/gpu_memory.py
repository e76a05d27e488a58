"""What a train actor leaves on the GPU after `sleep`, for the GPU tests of both backends: the
bytes, and when any remain, the live blocks with the Python stack that allocated each (the one
GPU run must say what is left, not only how much)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

BOUND = 0
"""Bytes of the caching allocator's that may stay allocated or reserved after sleep: none of ours.
The first GPU run left 67,108,864 B (FSDP: cuBLAS's workspaces) and 67,140,096 B (Megatron: the
same, plus 31,232 B of megatron-core's rotary tables, a count reproduced exactly on CPU); sleep
releases both now. The CUDA context, NCCL's and cuBLAS's handles are not the allocator's."""


def record_allocations() -> None:
    """Record the Python stack of every allocation from here on (in the rank process, before the
    actor starts), so a leftover block names its allocator."""
    try:
        torch.cuda.memory._record_memory_history(
            enabled="all", context="all", stacks="python", max_entries=10_000
        )
    except Exception as e:  # a private API: the blocks are still listed, without stacks
        print(f"no allocation stacks: torch.cuda.memory._record_memory_history failed: {e!r}")


def left_on_device(limit: int = 30) -> dict[str, Any]:
    """This process's allocated and reserved bytes, and its live blocks (largest first, `limit` of
    them) as lines of text: size, requested size, address, allocating stack."""
    torch.cuda.synchronize()
    blocks = [
        block
        for segment in torch.cuda.memory_snapshot()
        for block in segment.get("blocks", [])
        if block.get("state") == "active_allocated"
    ]
    blocks.sort(key=lambda b: -b["size"])
    lines = [
        f"{b['size']:>12,} B (requested {b.get('requested_size', '?')}) at {b.get('address', 0):#x}: {_stack(b)}"
        for b in blocks[:limit]
    ]
    if len(blocks) > limit:
        lines.append(f"... and {len(blocks) - limit} more blocks")
    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "blocks": lines,
    }


def _stack(block: dict[str, Any], depth: int = 8) -> str:
    """The allocating frames, innermost first, from the first one outside torch itself."""
    frames = [f for f in block.get("frames", []) if f.get("filename")]
    if not frames:
        return "no stack recorded"
    outside = [i for i, f in enumerate(frames) if "/torch/" not in f["filename"]]
    start = outside[0] if outside else 0
    return " <- ".join(
        f"{f['filename']}:{f.get('line', '?')} {f.get('name', '')}" for f in frames[start : start + depth]
    )


def assert_released(left: dict[str, Any], what: str) -> None:
    """`left` (from `left_on_device` after sleep) is within BOUND; prints the figures either way."""
    print(f"{what}: after sleep {left['allocated']:,} B allocated, {left['reserved']:,} B reserved")
    assert left["allocated"] <= BOUND and left["reserved"] <= BOUND, (
        f"{what}: {left['allocated']:,} B still allocated and {left['reserved']:,} B reserved after sleep "
        f"(allowed: {BOUND}); live blocks, largest first:\n" + "\n".join(left["blocks"] or ["(none listed)"])
    )


def run_checks(*checks: Callable[[], None]) -> None:
    """Run every check, then fail with all their messages: one GPU run reports every problem."""
    problems = []
    for check in checks:
        try:
            check()
        except AssertionError as e:
            problems.append(f"{type(e).__name__}: {e}")
    assert not problems, "\n\n".join(problems)
