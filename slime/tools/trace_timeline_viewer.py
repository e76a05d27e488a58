"""A timeline of the traces in a rollout dump (`--save-debug-rollout-data`), as a web page.

    python -m slime.tools.trace_timeline_viewer DUMP [--no-serve] [--port P] [--host H] [--rebuild]

Writes two files beside DUMP (slime's names): `<stem>.trace_timeline_cache.json`, each traced
sample's spans and events laid out for drawing, and `<stem>.trace_timeline_viewer.html`, a
self-contained page (the data embedded in it; no network) with one row per sample: spans as bars,
nested spans one lane below their parent, instant events as points, a time axis, and a details
panel that shows what was recorded with a span or an event when it is clicked. Then, unless
`--no-serve`, it serves that page alone (not the rest of the folder) on H (default loopback) with
Python's http.server and prints its URL; Ctrl-C stops it (`--port 0` takes a free port).

A trace is the `trace` payload of a sample (slime.observability.trace_utils): `{"version",
"trace_id", "sample_id", "group_id", "attempt", "events"}`, each event `{"type": "span_start" |
"span_end" | "event", "name", "ts", "span_id", "parent_span_id", "attrs", ...}`. A span_start
without its span_end is drawn open up to the next thing that bounds it (see `_bound_open_span`)
and says so in its details; a span_end without a start is kept as an "orphan_end" point. The
cache is reused while it is newer than the dump (`--rebuild` rebuilds it).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import html
import json
import math
import os
import stat
import sys
import time
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from slime.rollout.dump import DumpError
from slime.tools.trace_timeline_page import HTML_TEMPLATE
from slime.utils.files import atomic_write_text

CACHE_VERSION = 1
EXPECTED = "a rollout dump (.pt) written by --save-debug-rollout-data"


@dataclass(frozen=True)
class TimelinePaths:
    dump: str
    cache: str
    html: str


def timeline_paths(dump: str) -> TimelinePaths:
    """slime's file names: `<stem>.trace_timeline_cache.json` and `.trace_timeline_viewer.html`."""
    dump = os.path.abspath(dump)
    stem = os.path.splitext(dump)[0]
    return TimelinePaths(dump, f"{stem}.trace_timeline_cache.json", f"{stem}.trace_timeline_viewer.html")


def read_samples(path: str) -> list[dict[str, Any]]:
    """The sample dicts of a dump; DumpError (one line, naming the file) when it is not one."""
    if not os.path.exists(path):
        raise DumpError(f"{path}: no such file (expected {EXPECTED})")
    if not os.path.isfile(path):
        raise DumpError(f"{path}: not a file (expected {EXPECTED})")
    import torch  # here: --help and the error lines above need no torch

    try:
        dump = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:
        raise DumpError(
            f"{path}: not {EXPECTED}: torch.load(weights_only=True) failed ({_load_failure(e)})"
        ) from None
    samples = dump.get("samples") if isinstance(dump, dict) else None
    if not isinstance(samples, list):
        raise DumpError(
            f"{path}: not {EXPECTED}: expected a dict with a 'samples' list, found {type(dump).__name__}"
        )
    for i, sample in enumerate(samples):
        if not isinstance(sample, dict):
            raise DumpError(
                f"{path}: sample {i} is a {type(sample).__name__}, expected a dict (Sample.to_dict())"
            )
    return samples


def _load_failure(error: Exception) -> str:
    """The one sentence of torch.load's error that says what was wrong (its messages are paragraphs
    of advice around the unpickler's complaint)."""
    text = str(error).split("WeightsUnpickler error:", 1)[-1].strip().split("\n\n")[0]
    return " ".join(text.split()).split(". ")[0][:200] or type(error).__name__


def _plain(value: Any) -> Any:
    """A JSON value the page can parse: NaN and infinities become strings, other objects their repr."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):  # tensors and numpy values
        return _plain(value.tolist())
    return repr(value)[:256]


def _short(value: Any, limit: int = 256) -> Any:
    value = _plain(value)
    return value[:limit] + "…" if isinstance(value, str) and len(value) > limit else value


def _round(value: float | None) -> float | None:
    return None if value is None else round(float(value), 6)


def _timestamp(event: dict[str, Any]) -> float | None:
    try:
        ts = float(event["ts"])
    except (KeyError, TypeError, ValueError):
        return None
    return ts if math.isfinite(ts) else None


def _pair_events(events: list[Any]) -> tuple[list[dict], list[dict], list[dict]]:
    """(spans, point events, orphan ends) in record order. A parent missing from an event is the
    innermost span of its attempt open when it was recorded (what trace_utils would have named)."""
    spans: list[dict] = []
    points: list[dict] = []
    orphans: list[dict] = []
    started: dict[str, dict] = {}
    stack: list[str] = []
    for raw in events:
        ts = _timestamp(raw) if isinstance(raw, dict) else None
        if ts is None:
            continue
        kind, span_id, attempt = raw.get("type"), raw.get("span_id"), int(raw.get("attempt") or 0)
        # Never a span of another attempt: a retry is no part of the attempt it replaced.
        same = [s for s in stack if s in started and started[s]["attempt"] == attempt]
        parent = raw.get("parent_span_id") or (same[-1] if same else None)
        base = {"name": str(raw.get("name") or kind), "attempt": attempt, "parent": parent}
        attrs = _plain(raw.get("attrs") or {})
        if kind == "span_start" and span_id:
            started[span_id] = {**base, "span_id": span_id, "start": ts, "end": None, "start_attrs": attrs}
            spans.append(started[span_id])
            stack.append(span_id)
        elif kind == "span_end":
            span = started.pop(span_id, None) if span_id else None
            if span is None:
                orphans.append({**base, "span_id": span_id, "ts": ts, "attrs": attrs})
                continue
            span["end"], span["end_attrs"] = ts, attrs
            if span_id in stack:
                stack.remove(span_id)
        else:
            points.append({**base, "ts": ts, "attrs": attrs})
    return spans, points, orphans


def _depths(spans: list[dict]) -> dict[str, int]:
    """Nesting depth of every span: 0 for a span whose parent is not in this trace (or a cycle)."""
    parent_of = {s["span_id"]: s["parent"] for s in spans}
    depth: dict[str, int] = {}

    def resolve(span_id: str, seen: frozenset[str]) -> int:
        if span_id not in depth:
            parent = parent_of[span_id]
            inside = parent in parent_of and parent not in seen
            depth[span_id] = resolve(parent, seen | {span_id}) + 1 if inside else 0
        return depth[span_id]

    for span_id in parent_of:
        resolve(span_id, frozenset())
    return depth


def _bound_open_span(span: dict, spans: list[dict], by_id: dict[str, dict], row_end: float) -> None:
    """Where an open span (no span_end) is drawn to: the row's last timestamp, or sooner the start
    of its next sibling or the end of its nearest closed ancestor (what must have ended it)."""
    bounds = [(row_end, "row_end")]
    later = [s["start"] for s in spans if s["parent"] == span["parent"] and s["start"] > span["start"]]
    if later:
        bounds.append((min(later), "next_sibling_start"))
    ancestor = by_id.get(span["parent"])
    seen: set[str] = set()
    while ancestor is not None and ancestor["end"] is None and ancestor["span_id"] not in seen:
        seen.add(ancestor["span_id"])
        ancestor = by_id.get(ancestor["parent"])
    if ancestor is not None and ancestor["end"] is not None and ancestor["end"] > span["start"]:
        bounds.append((ancestor["end"], "ancestor_end"))
    end, clipped_by = min(bounds)
    span["display_end"] = max(end, span["start"])
    span["end_attrs"] = {"clipped_by": clipped_by}


def _placed(record: dict, by_id: dict[str, dict], lane: int) -> dict[str, Any]:
    """The fields every item has: where it sits and under which span."""
    parent = by_id.get(record["parent"])
    return {
        "name": record["name"],
        "attempt": record["attempt"],
        "parent_span_id": record["parent"],
        "parent_span_name": parent["name"] if parent is not None else None,
        "lane": lane,
        "depth": lane,
    }


def _items(spans: list[dict], points: list[dict], orphans: list[dict]) -> list[dict[str, Any]]:
    """The cache's items (slime's fields, plus `duration` on spans), ordered by lane and time."""
    by_id = {s["span_id"]: s for s in spans}
    depth = _depths(spans)
    stamps = [t for s in spans for t in (s["start"], s["end"]) if t is not None]
    row_end = max(stamps + [p["ts"] for p in points + orphans])
    items: list[dict[str, Any]] = []
    for s in spans:
        if s["end"] is None:
            _bound_open_span(s, spans, by_id, row_end)
        shown_end = s["end"] if s["end"] is not None else s["display_end"]
        timing = {
            "start_ts": _round(s["start"]),
            "end_ts": _round(s["end"]),
            "display_end_ts": _round(shown_end),
        }
        items.append(
            {
                "type": "span",
                "state": "closed_span" if s["end"] is not None else "open_span",
                **_placed(s, by_id, depth[s["span_id"]]),
                **timing,
                "duration": _round(shown_end - s["start"]),
                "span_id": s["span_id"],
                "attrs": {"start_attrs": s["start_attrs"], "end_attrs": s.get("end_attrs", {})},
            }
        )
    for kind, state, group in (("event", "point_event", points), ("orphan_end", "orphan_end", orphans)):
        for p in group:
            lane = depth[p["parent"]] + 1 if p["parent"] in depth else 0
            placed = _placed(p, by_id, lane)
            items.append(
                {
                    "type": kind,
                    "state": state,
                    **placed,
                    "ts": _round(p["ts"]),
                    "span_id": p.get("span_id"),
                    "attrs": p["attrs"],
                }
            )
    return sorted(items, key=lambda i: (i["lane"], *_extent(i), i["name"]))


def _extent(item: dict[str, Any]) -> tuple[float, float]:
    """Where an item is drawn: (start, end); a point's are equal."""
    if item["type"] == "span":
        return item["start_ts"], item["display_end_ts"]
    return item["ts"], item["ts"]


def _attr_values(item: dict[str, Any], key: str) -> list[Any]:
    """`key`'s values in an item's attrs (a span's start and end attrs, an event's attrs)."""
    attrs = item["attrs"]
    found = [part for part in (attrs.get("start_attrs"), attrs.get("end_attrs")) if isinstance(part, dict)]
    return [part[key] for part in ([attrs] if item["type"] != "span" else found) if key in part]


def build_row(sample: dict[str, Any], row_id: int) -> dict[str, Any] | None:
    """One sample's row of the timeline, or None when it carries no trace events."""
    trace = sample.get("trace")
    if not isinstance(trace, dict) or not isinstance(trace.get("events"), list):
        return None
    spans, points, orphans = _pair_events(trace["events"])
    if not (spans or points or orphans):
        return None
    items = _items(spans, points, orphans)
    start = min(_extent(i)[0] for i in items)
    end = max(_extent(i)[1] for i in items)
    states = [i["state"] for i in items]
    lengths = [
        int(v) for i in items for v in _attr_values(i, "response_length") if isinstance(v, int | float)
    ]
    metadata = sample.get("metadata")
    metadata = metadata if isinstance(metadata, dict) else {}
    source = sample.get("source") or metadata.get("source") or metadata.get("source_name")
    return {
        "row_id": row_id,
        "sample_index": _plain(sample.get("index", row_id)),
        "group_index": _plain(sample.get("group_index")),
        "source": _short(source, 64),
        "status": _short(sample.get("status")),
        "label": _short(sample.get("label")),
        "reward": _plain(sample.get("reward")),
        "trace_id": _plain(trace.get("trace_id")),
        "attempt": int(trace.get("attempt") or 0),
        "start": start,
        "end": end,
        "duration": _round(end - start),
        "lane_count": 1 + max(i["lane"] for i in items),
        "item_count": len(items),
        **{f"{state}_count": states.count(state) for state in ("closed_span", "open_span", "point_event")},
        "orphan_count": states.count("orphan_end"),
        "total_response_length": sum(lengths),
        "max_response_length": max(lengths, default=0),
        "items": items,
    }


def build_cache(dump: str, samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The cache file's contents: slime's layout, `rows` one per traced sample in dump order."""
    rows = [r for r in (build_row(s, i) for i, s in enumerate(samples)) if r is not None]
    return {
        "cache_version": CACHE_VERSION,
        "pt_path": dump,
        "generated_at": time.time(),
        "sample_count": len(rows),
        "dump_sample_count": len(samples),
        "global_start": _round(min((r["start"] for r in rows), default=None)),
        "global_end": _round(max((r["end"] for r in rows), default=None)),
        "rows": rows,
    }


def _fresh_cache(paths: TimelinePaths) -> dict[str, Any] | None:
    """The cache file's contents when it is of this version, for this dump and newer than it."""
    if not (os.path.isfile(paths.dump) and os.path.isfile(paths.cache)):
        return None
    if os.path.getmtime(paths.cache) < os.path.getmtime(paths.dump):
        return None
    try:
        with open(paths.cache, encoding="utf-8") as f:
            cached = json.load(f)
    except (OSError, ValueError):
        return None
    # "dump_sample_count" marks a cache this tool wrote: one from slime's viewer is rebuilt
    fits = (
        isinstance(cached, dict)
        and cached.get("cache_version") == CACHE_VERSION
        and "dump_sample_count" in cached
    )
    return cached if fits and cached.get("pt_path") == paths.dump else None


def load_or_build_cache(paths: TimelinePaths, rebuild: bool) -> dict[str, Any]:
    """The cache, read back while it is fresh (see _fresh_cache), else rebuilt and written."""
    cached = None if rebuild else _fresh_cache(paths)
    if cached is not None:
        return cached
    cache = build_cache(paths.dump, read_samples(paths.dump))
    write_beside(paths.cache, json.dumps(cache, ensure_ascii=True, separators=(",", ":")), paths.dump)
    return cache


def write_beside(path: str, text: str, dump: str) -> None:
    """Write `path` atomically, readable by whoever may read the dump it was made from (the
    temporary file the atomic write renames is created owner-only)."""
    atomic_write_text(path, text)
    os.chmod(path, stat.S_IMODE(os.stat(dump).st_mode) & 0o666)


def no_trace_notice(cache: dict[str, Any]) -> str | None:
    """The line saying that a dump has nothing to show, or None."""
    if cache["rows"]:
        return None
    return (
        f"No traces in {os.path.basename(cache['pt_path'])}: none of its "
        f"{cache.get('dump_sample_count', '?')} samples carries trace events (the rollout recorded no "
        "`trace` payloads)"
    )


def render_html(cache: dict[str, Any]) -> str:
    """The page: HTML_TEMPLATE with the cache embedded (`</` escaped so no string ends the script)."""
    data = json.dumps(cache, ensure_ascii=True, separators=(",", ":")).replace("</", "<\\/")
    notice = no_trace_notice(cache)
    title = f"{os.path.basename(cache['pt_path'])} trace timeline"
    return (
        HTML_TEMPLATE.replace("__TITLE__", html.escape(title))
        .replace("__NOTICE__", f'<p id="notice">{html.escape(notice)}</p>' if notice else "")
        .replace("__DATA__", data)
    )


class _PageHandler(SimpleHTTPRequestHandler):
    """The page alone (its data is in it): nothing else of the dump's folder is served, which may
    hold the dumps and other files of the user's."""

    page = ""

    def send_head(self) -> Any:
        if self.path.split("?", 1)[0].split("#", 1)[0] != "/" + self.page:
            self.send_error(404, "only the timeline page is served here")
            return None
        return super().send_head()

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would bury the URL


def serve(directory: str, host: str, port: int, page: str) -> None:
    """Serve `page` of `directory` until Ctrl-C, printing its URL (with the port actually bound)."""
    handler = functools.partial(type("Handler", (_PageHandler,), {"page": page}), directory=directory)
    with ThreadingHTTPServer((host, port), handler) as server:
        bound_port = server.server_address[1]
        print(f"serving http://{host}:{bound_port}/{page}  (Ctrl-C stops)", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slime.tools.trace_timeline_viewer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("dump", help="a rollout dump (.pt) written by --save-debug-rollout-data")
    parser.add_argument(
        "--serve",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the page (--no-serve: write only)",
    )
    parser.add_argument("--port", type=int, default=9999, help="port to serve on (0: a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="IPv4 address to serve on (default: loopback)")
    parser.add_argument(
        "--rebuild", action="store_true", help="rebuild the cache even when it is newer than the dump"
    )
    args = parser.parse_args(argv)
    paths = timeline_paths(args.dump)
    try:
        cache = load_or_build_cache(paths, args.rebuild)
    except DumpError as e:
        print(f"trace_timeline_viewer: {e}", file=sys.stderr)
        return 2
    write_beside(paths.html, render_html(cache), paths.dump)
    print(f"cache: {paths.cache}\nhtml: {paths.html}")
    print(
        no_trace_notice(cache)
        or f"samples: {cache['sample_count']} traced of {cache.get('dump_sample_count')}"
    )
    if args.serve:
        try:
            serve(os.path.dirname(paths.html), args.host, args.port, os.path.basename(paths.html))
        except OSError as e:
            print(f"trace_timeline_viewer: cannot serve on {args.host}:{args.port} ({e})", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
