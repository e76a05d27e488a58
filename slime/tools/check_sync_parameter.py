"""Compare the engine parameter dumps made before and after the first weight push.

    python -m slime.tools.check_sync_parameter --root_dir DIR [--atol X] [--rtol Y] [--json]

DIR is what `--debug-sync-parameters-path` (or DEBUG_SYNC_PARAMETERS_PATH) wrote:
DIR/before_sync_parameter/<rank>/<HF name> and DIR/after_sync_parameter/<rank>/<HF name>, one
torch.save'd tensor per file. The trainer loaded the checkpoint the engines loaded, so every
"after" tensor must equal its "before" one; one line per parameter and rank:

    PASS|<rank>|<name>
    DIFF|<rank>|<name>|<after shape>|<after mean>|<before shape>|<before mean>|max_abs=<x>|first_index=<i>
    MISSING_AFTER|<rank>|<name>       (dumped before the push, not after)
    MISSING_BEFORE|<rank>|<name>      (dumped after the push only)

then `ALL: n, PASS: p, DIFF: d, MISSING: m`. Exact by default (`--atol`/`--rtol` relax it:
|after - before| <= atol + rtol * |before|). Exit code 0 only when every parameter passes,
1 otherwise, 2 when DIR holds no dumps. Each pair of files is memory-mapped and compared in
chunks, so dumps larger than memory are fine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

CHUNK_ELEMENTS = 1 << 24  # 128 MiB of float64 differences at a time
PARTS = ("before_sync_parameter", "after_sync_parameter")


def _ranks(root: str) -> list[str]:
    found: set[str] = set()
    for part in PARTS:
        folder = os.path.join(root, part)
        if os.path.isdir(folder):
            found.update(d for d in os.listdir(folder) if os.path.isdir(os.path.join(folder, d)))
    return sorted(found, key=lambda r: (not r.isdigit(), int(r) if r.isdigit() else 0, r))


def _names(folder: str) -> set[str]:
    if not os.path.isdir(folder):
        return set()
    return {
        f
        for f in os.listdir(folder)
        if not f.endswith(".partial") and os.path.isfile(os.path.join(folder, f))
    }


def _load(path: str) -> torch.Tensor:
    value = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{path}: holds a {type(value).__name__}, not a tensor")
    return value


def compare_tensors(
    after: torch.Tensor, before: torch.Tensor, atol: float, rtol: float, chunk: int = CHUNK_ELEMENTS
) -> dict[str, Any]:
    """Chunked comparison: max |after - before|, the first flat index out of tolerance, and
    both means (float64 accumulation)."""
    a, b = after.reshape(-1), before.reshape(-1)
    worst, first = 0.0, -1
    sums = [0.0, 0.0]
    for start in range(0, a.numel(), chunk):
        x, y = a[start : start + chunk].double(), b[start : start + chunk].double()
        sums[0] += float(x.sum())
        sums[1] += float(y.sum())
        diff = (x - y).abs()
        both_nan = x.isnan() & y.isnan()
        diff = torch.where(both_nan, torch.zeros_like(diff), diff)  # a NaN dumped twice is the same value
        bad = (diff > atol + rtol * y.abs()) | diff.isnan()
        if diff.numel():
            worst = max(worst, float(diff.nan_to_num(nan=math.inf).max()))
        if first < 0 and bool(bad.any()):
            first = start + int(bad.nonzero()[0])
    n = max(a.numel(), 1)
    return {"max_abs": worst, "first_index": first, "after_mean": sums[0] / n, "before_mean": sums[1] / n}


def check(
    root: str, atol: float = 0.0, rtol: float = 0.0, chunk: int = CHUNK_ELEMENTS
) -> Iterator[dict[str, Any]]:
    """One result per (rank, parameter), rank by rank and name by name; streams the files."""
    for rank in _ranks(root):
        before_dir, after_dir = (os.path.join(root, part, rank) for part in PARTS)
        before, after = _names(before_dir), _names(after_dir)
        for name in sorted(before | after):
            if name not in after:
                yield {"status": "MISSING_AFTER", "rank": rank, "name": name}
                continue
            if name not in before:
                yield {"status": "MISSING_BEFORE", "rank": rank, "name": name}
                continue
            a, b = _load(os.path.join(after_dir, name)), _load(os.path.join(before_dir, name))
            row: dict[str, Any] = {
                "rank": rank,
                "name": name,
                "after_shape": list(a.shape),
                "before_shape": list(b.shape),
            }
            if a.shape != b.shape:
                row.update(
                    status="DIFF",
                    max_abs=None,
                    first_index=None,
                    after_mean=float(a.double().mean()) if a.numel() else 0.0,
                    before_mean=float(b.double().mean()) if b.numel() else 0.0,
                )
            else:
                row.update(compare_tensors(a, b, atol, rtol, chunk))
                row["status"] = "PASS" if row["first_index"] < 0 and a.dtype == b.dtype else "DIFF"
            del a, b
            yield row


def format_line(row: dict[str, Any]) -> str:
    if row["status"] != "DIFF":
        return f"{row['status']}|{row['rank']}|{row['name']}"

    def shape(s: list[int]) -> str:
        return str(torch.Size(s))

    def mean(m: float) -> str:
        return str(torch.tensor(m, dtype=torch.float32))

    max_abs = "n/a" if row["max_abs"] is None else f"{row['max_abs']:.6g}"
    first = "n/a" if row["first_index"] is None else str(row["first_index"])
    return (
        f"DIFF|{row['rank']}|{row['name']}|{shape(row['after_shape'])}|{mean(row['after_mean'])}|"
        f"{shape(row['before_shape'])}|{mean(row['before_mean'])}|max_abs={max_abs}|first_index={first}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slime.tools.check_sync_parameter",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--root_dir",
        "--root-dir",
        dest="root_dir",
        required=True,
        help="the --debug-sync-parameters-path directory",
    )
    parser.add_argument("--atol", type=float, default=0.0, help="absolute tolerance (default: exact)")
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default: exact)")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = parser.parse_args(argv)
    if args.atol < 0 or args.rtol < 0:
        parser.error("--atol and --rtol must be >= 0")
    if not any(os.path.isdir(os.path.join(args.root_dir, part)) for part in PARTS):
        parser.error(
            f"--root_dir {args.root_dir!r} holds neither before_sync_parameter/ nor after_sync_parameter/: "
            "run the job with --debug-sync-parameters-path DIR (or DEBUG_SYNC_PARAMETERS_PATH=DIR) first"
        )
    counts = {"PASS": 0, "DIFF": 0, "MISSING": 0}
    rows = []
    try:
        for row in check(args.root_dir, args.atol, args.rtol):
            counts["MISSING" if row["status"].startswith("MISSING") else row["status"]] += 1
            if args.json:
                rows.append(row)
            else:
                print(format_line(row), flush=True)
    except (OSError, ValueError, RuntimeError) as e:
        parser.error(f"--root_dir {args.root_dir!r}: cannot read a dump: {e}")
    total = sum(counts.values())
    if args.json:
        print(json.dumps({"results": rows, "summary": {"ALL": total, **counts}}))
    else:
        print(f"ALL: {total}, PASS: {counts['PASS']}, DIFF: {counts['DIFF']}, MISSING: {counts['MISSING']}")
    return 0 if total and counts["PASS"] == total else 1


if __name__ == "__main__":
    sys.exit(main())
