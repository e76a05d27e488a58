"""What a train actor leaves on the GPU after `sleep`, for the GPU tests of both backends: the
bytes, and when any remain, the live blocks with the Python stack that allocated each (the one
GPU run must say what is left, not only how much)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

BOUND = 0
"""Bytes that may stay allocated after sleep: none of ours. The first GPU run left 67,108,864 B
(FSDP: cuBLAS's workspaces) and 67,140,096 B (Megatron: the same, plus 31,232 B of megatron-core's
rotary tables, a count reproduced exactly on CPU); sleep releases both now."""

RESERVED_BOUND = 0
"""Bytes the caching allocator may keep reserved after sleep: none. The second GPU run (H200,
torch 2.11) left one 2 MiB small-block segment in both backends with 0 B allocated: a 1 KiB
optimizer-state tensor that a loop variable of `_move` held until after the release, so its
segment outlived empty_cache. `_move` no longer holds one (a CPU test checks its frame); a run
since would show 0 here. The segments are listed whenever any is reserved."""


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
        f"{b['size']:>12,} B (requested {b.get('requested_size', '?')}) at {b.get('address', 0):#x}: "
        f"{_stack(b)}"
        for b in blocks[:limit]
    ]
    if len(blocks) > limit:
        lines.append(f"... and {len(blocks) - limit} more blocks")
    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "blocks": lines,
        "segments": _segments(),
    }


def _segments(limit: int = 8) -> list[str]:
    """The reserved segments: size, pool, stream, and the blocks in each with the stack that last
    allocated them (recorded history), or the last traced events at their addresses."""
    try:
        snapshot = torch.cuda.memory._snapshot()
    except Exception as e:  # a private API
        return [f"(no snapshot: {e!r})"]
    traces = [t for device in snapshot.get("device_traces", []) for t in device]
    lines = []
    for seg in snapshot.get("segments", [])[:limit]:
        start, size = seg.get("address", 0), seg.get("total_size", 0)
        lines.append(
            f"segment {size:,} B at {start:#x} pool {seg.get('segment_pool_id')} stream "
            f"{seg.get('stream')} type {seg.get('segment_type')} allocated "
            f"{seg.get('allocated_size', 0):,} B"
        )
        for block in seg.get("blocks", [])[:4]:
            lines.append(f"    block {block.get('size', 0):,} B {block.get('state')}: {_stack(block)}")
        inside = [t for t in traces if start <= t.get("addr", -1) < start + size][-4:]
        for t in inside:
            lines.append(f"    trace {t.get('action')} {t.get('size', 0):,} B: {_stack(t)}")
    return lines


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
    """`left` (from `left_on_device` after sleep) is within the bounds; prints the figures, and the
    reserved segments if any, either way."""
    print(f"{what}: after sleep {left['allocated']:,} B allocated, {left['reserved']:,} B reserved")
    if left["reserved"]:
        print("\n".join(left.get("segments") or ["(no segments listed)"]))
    assert left["allocated"] <= BOUND and left["reserved"] <= RESERVED_BOUND, (
        f"{what}: {left['allocated']:,} B still allocated and {left['reserved']:,} B reserved after sleep "
        f"(allowed: {BOUND} and {RESERVED_BOUND:,}); live blocks, largest first:\n"
        + "\n".join(left["blocks"] or ["(none listed)"])
        + "\nsegments:\n"
        + "\n".join(left.get("segments") or ["(none listed)"])
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
