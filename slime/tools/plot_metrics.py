"""Plot a run's reward and accuracy per step from its metrics.jsonl.

    python -m slime.tools.plot_metrics LOG_DIR/metrics.jsonl [--out PLOT.png]
        [--keys rollout/reward_mean eval/accuracy]

One line per key against `step` (rollouts trained so far; the eval before training is step 0).
The PNG goes next to the metrics file unless `--out` says otherwise. Needs matplotlib
(`pip install matplotlib`, part of the `demo` extra).
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_KEYS = ["rollout/reward_mean", "eval/accuracy"]


def read_series(path: str, keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per key, in file order; records without the key are skipped."""
    from slime.rollout.data import read_rows

    series: dict[str, list[tuple[int, float]]] = {k: [] for k in keys}
    for _, record in read_rows(path, "metrics file"):
        for k in keys:
            if k in record and "step" in record:
                series[k].append((int(record["step"]), float(record[k])))
    return series


def plot(series: dict[str, list[tuple[int, float]]], out: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for key, points in series.items():
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if key.startswith("eval/") else None, markersize=3, label=key)
    ax.set_xlabel("step (rollouts trained)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    ax.set_title(title)
    fig.tight_layout()
    tmp = out + ".partial.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slime.tools.plot_metrics",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("metrics", help="a run's metrics.jsonl")
    parser.add_argument("--out", default=None, help="PNG path (default: reward_accuracy.png beside it)")
    parser.add_argument("--keys", nargs="+", default=DEFAULT_KEYS)
    parser.add_argument("--title", default="reward and accuracy per step")
    args = parser.parse_args(argv)
    if not os.path.isfile(args.metrics):
        parser.error(f"{args.metrics!r}: no such file")
    try:
        series = read_series(args.metrics, args.keys)
    except ValueError as e:  # DataError: the file:line of a bad record
        parser.error(str(e))
    if not any(series.values()):
        parser.error(f"{args.metrics!r} has none of the keys {args.keys}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error("plotting needs matplotlib: pip install matplotlib (or pip install -e '.[demo]')")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(args.metrics)), "reward_accuracy.png")
    plot(series, out, args.title)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
