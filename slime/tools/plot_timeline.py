"""A picture of a job's timeline (--trace-dir), for a bug report or where no trace viewer runs.

    python -m slime.tools.plot_timeline TRACE.json [--out PNG] [--from S] [--to S] [--width INCHES]

Reads a trace in Chrome's trace-event format (the JSON object with `traceEvents`, or the bare
array) and draws one band per row of each process's track, top to bottom in the trace's order:
spans as bars (a nested span thinner, inside its parent), each name in its own colour with the
longest-running names in the legend; counters as step lines scaled to their band (the largest
value written beside it); instants as small triangles. Time runs in seconds from the trace's
start; `--from`/`--to` cut a window. Perfetto (ui.perfetto.dev) and chrome://tracing show the same
file interactively; this is the still picture, drawn with matplotlib (`pip install "slime[demo]"`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

LEGEND_NAMES = 14
"""The names with the most time in spans, listed in the legend."""


@dataclass
class Row:
    label: str
    spans: list[tuple[float, float, str, int]] = field(default_factory=list)
    """(start s, end s, name, depth)."""
    counters: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    instants: list[tuple[float, str]] = field(default_factory=list)


def read_trace(path: str) -> list[dict[str, Any]]:
    """The events of a trace file; ValueError naming the file when it is not one."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable JSON trace ({e})") from e
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list) or not all(isinstance(e, dict) and "ph" in e for e in events):
        raise ValueError(f"{path}: no Chrome trace events in it (a file written by --trace-dir is expected)")
    return events


def rows_of(events: list[dict[str, Any]], start: float | None, end: float | None) -> list[Row]:
    """The rows to draw, in the trace's order of tracks and rows, with the window applied."""
    processes = {
        e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"
    }
    threads = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    by_row: dict[tuple[Any, Any], list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e["ph"] in ("X", "C", "i", "I"):
            by_row[(e["pid"], e["tid"])].append(e)
    rows = []
    for key in sorted(by_row, key=lambda k: (str(k[0]).zfill(8), str(k[1]).zfill(8))):
        pid, tid = key
        row = Row(f"{processes.get(pid, pid)} · {threads.get(key, tid)}")
        _fill(row, by_row[key], start, end)
        if row.spans or row.instants:
            rows.append(row)
        for name, points in row.counters.items():  # each series in a band of its own
            rows.append(Row(f"{processes.get(pid, pid)} · {name}", counters={name: points}))
        row.counters = {}
    return rows


def _fill(row: Row, events: list[dict[str, Any]], start: float | None, end: float | None) -> None:
    def inside(a: float, b: float) -> bool:
        return (start is None or b >= start) and (end is None or a <= end)

    stack: list[float] = []
    for e in sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0))):
        t = e["ts"] / 1e6
        if e["ph"] == "X":
            t_end = t + e.get("dur", 0) / 1e6
            while stack and stack[-1] <= t:
                stack.pop()
            if inside(t, t_end):
                row.spans.append((t, t_end, str(e["name"]), len(stack)))
            stack.append(t_end)
        elif e["ph"] == "C" and (end is None or t <= end):
            for series, value in (e.get("args") or {}).items():
                if isinstance(value, int | float):
                    points = row.counters.setdefault(f"{e['name']}.{series}", [])
                    if start is not None and t < start:  # the value the window starts with
                        points[:] = [(start, float(value))]
                    else:
                        points.append((t, float(value)))
        elif inside(t, t):
            row.instants.append((t, str(e["name"])))


def kind(name: str) -> str:
    """A span's name without its number (`rollout 3`, `bucket 0`): one colour for all of them."""
    return re.sub(r"\s*\d+$", "", name) or name


def palette(rows: list[Row]) -> dict[str, Any]:
    """A colour for each kind of span, the distinct ones of tab20 going to the kinds with the
    most time (the rest share grey); counters are drawn in dark grey."""
    from matplotlib import colormaps

    totals: dict[str, float] = defaultdict(float)
    for row in rows:
        for a, b, name, _ in row.spans:
            totals[kind(name)] += b - a
    ranked = sorted(totals, key=lambda n: -totals[n])
    tab20 = colormaps["tab20"]
    out: dict[str, Any] = {n: tab20(k) if k < tab20.N else "0.6" for k, n in enumerate(ranked)}
    return out | {name: "0.2" for row in rows for name in row.counters}


def draw(
    rows: list[Row], out: str, width: float, title: str, window: tuple[float | None, float | None]
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(width, 0.42 * len(rows) + 1.6))
    colours = palette(rows)
    for y, row in enumerate(rows):
        for a, b, name, depth in row.spans:
            height = 0.8 * 0.7**depth
            ax.broken_barh([(a, max(b - a, 1e-6))], (y - height / 2, height), color=colours[kind(name)], lw=0)
        for name, points in row.counters.items():
            peak = max(v for _, v in points) or 1.0
            xs, ys = zip(*points, strict=True)
            ax.step(xs, [y + 0.4 - 0.8 * v / peak for v in ys], where="post", lw=0.8, color=colours[name])
            ax.text(
                1.0,
                y - 0.4,
                f"max {peak:g} ",
                fontsize=6,
                va="top",
                ha="right",
                transform=ax.get_yaxis_transform(),
            )
        if row.instants:
            ax.plot([t for t, _ in row.instants], [y] * len(row.instants), "v", ms=4, color="black")
    ax.set_yticks(range(len(rows)), [r.label for r in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlim(*window)
    ax.set_xlabel("seconds since the trace's start")
    ax.set_title(title, fontsize=9)
    ax.grid(axis="x", lw=0.3)
    counters = {n for row in rows for n in row.counters}
    named = [n for n in colours if n not in counters][:LEGEND_NAMES]
    ax.legend(
        handles=[Patch(color=colours[n], label=n) for n in named],
        fontsize=6,
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
    )
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a trace file written by --trace-dir (trace-*.json)")
    parser.add_argument("--out", help="the picture (default: the trace's path with .png)")
    parser.add_argument("--from", dest="start", type=float, help="the window's start, in seconds")
    parser.add_argument("--to", dest="end", type=float, help="the window's end, in seconds")
    parser.add_argument("--width", type=float, default=16.0, help="inches (16)")
    args = parser.parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print(
            'plot_timeline draws with matplotlib: pip install "slime[demo]" (or matplotlib)', file=sys.stderr
        )
        return 2
    try:
        events = read_trace(args.trace)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    rows = rows_of(events, args.start, args.end)
    if not rows:
        print(f"{args.trace}: no spans, counters or instants in the window asked for", file=sys.stderr)
        return 2
    out = args.out or os.path.splitext(args.trace)[0] + ".png"
    draw(rows, out, args.width, os.path.basename(args.trace), (args.start, args.end))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
