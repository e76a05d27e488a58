"""The `slow` tests cut into shards, one of which CI runs after the default suite.

    pytest -m slow --slow-shard K/N -n 2 --dist loadgroup    # shard K (0-based) of N, locally
    python -m tests.slow_shards --which                      # the shard CI runs for this commit
    python -m tests.slow_shards --write report.xml           # durations from `pytest --junitxml`

Every slow test belongs to exactly one shard: the tests are taken longest first and each goes to
the shard with the least time so far (the seconds each took, from `slow_durations.json`; a test
not listed counts `UNKNOWN_S`), so the shards take about the same time and every test of the
suite, a new one included, lands in one. CI runs shard `commits on HEAD % N`: consecutive landings
cover every shard within N landings (more if a landing brings several commits at once).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterable

DURATIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_durations.json")
UNKNOWN_S = 60.0
"""The seconds a slow test not in the durations file is counted (a typical end-to-end job)."""


def load() -> tuple[int, dict[str, float]]:
    """(the number of shards, seconds by test node id) from slow_durations.json."""
    with open(DURATIONS) as f:
        data = json.load(f)
    return int(data["shards"]), {k: float(v) for k, v in data["seconds"].items()}


def assign(nodeids: Iterable[str], shards: int, seconds: dict[str, float]) -> dict[str, int]:
    """Each test's shard: longest first, each to the least loaded shard (ties: the lowest index)."""
    load_s = [0.0] * shards
    out = {}
    for nodeid in sorted(nodeids, key=lambda n: (-seconds.get(n, UNKNOWN_S), n)):
        k = min(range(shards), key=lambda i: (load_s[i], i))
        out[nodeid] = k
        load_s[k] += seconds.get(nodeid, UNKNOWN_S)
    return out


def parse_shard(text: str) -> tuple[int, int]:
    """`K/N` -> (K, N), 0 <= K < N."""
    try:
        k, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise ValueError(f"--slow-shard {text!r}: expected K/N, e.g. 0/3") from None
    if not 0 <= k < n:
        raise ValueError(f"--slow-shard {text}: K must be in [0, {n})")
    return k, n


def junit_seconds(path: str) -> dict[str, float]:
    """Seconds by node id from a `pytest --junitxml` report (classname + name, as pytest ids)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        if not module:  # a module skipped as a whole (no test of its own)
            continue
        name = re.sub(r"@[\w-]+$", "", case.get("name", ""))  # pytest-xdist's `@group` suffix
        out[f"{module}.py::{name}"] = round(float(case.get("time", 0.0)), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--which", action="store_true", help="print K/N, the shard CI runs for HEAD")
    parser.add_argument("--write", metavar="JUNIT_XML", help="write slow_durations.json from a report")
    parser.add_argument("--shards", type=int, default=None, help="with --write: N (default: the file's)")
    args = parser.parse_args(argv)
    if args.write:
        seconds = junit_seconds(args.write)
        shards = args.shards or (load()[0] if os.path.exists(DURATIONS) else 1)
        with open(DURATIONS, "w") as f:
            json.dump({"shards": shards, "seconds": dict(sorted(seconds.items()))}, f, indent=1)
            f.write("\n")
        per = [0.0] * shards
        for nodeid, k in assign(seconds, shards, seconds).items():
            per[k] += seconds[nodeid]
        print(
            f"{len(seconds)} tests, {sum(seconds.values()) / 60:.1f} min in all; per shard (min): "
            + ", ".join(f"{s / 60:.1f}" for s in per)
        )
    if args.which:
        shards, _ = load()
        commits = int(
            subprocess.run(
                ["git", "rev-list", "--count", "HEAD"], capture_output=True, text=True, check=True
            ).stdout
        )
        print(f"{commits % shards}/{shards}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
