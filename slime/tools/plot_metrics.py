"""Plot a run's reward and accuracy per step from its metrics.jsonl, or several runs' side by side.

    python -m slime.tools.plot_metrics LOG_DIR/metrics.jsonl [--out PLOT.png]
        [--keys rollout/reward_mean eval/accuracy]
    python -m slime.tools.plot_metrics GRPO=runs/a/logs/metrics.jsonl OPD=runs/b/logs/metrics.jsonl \\
        --out cmp.png
    python -m slime.tools.plot_metrics LOG_DIR/metrics.jsonl --since START   (the demos' last line)

One line per key (and run) against `step` (rollouts trained so far; the eval before training is
step 0). A run given as LABEL=PATH is named LABEL in the legend. The PNG goes next to the first
metrics file unless `--out` says otherwise. With `--since` (a Unix time: when the run began) it
also prints the first and the last held-out accuracy (`eval/accuracy`) and the seconds since,
the line the demo scripts end with. Needs matplotlib (`pip install matplotlib`, part of the
`demo` extra).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

DEFAULT_KEYS = ["rollout/reward_mean", "eval/accuracy"]


def read_series(path: str, keys: list[str]) -> dict[str, list[tuple[int, float]]]:
    """(step, value) per key, in file order; records without the key are skipped."""
    from slime.utils.data_files import read_rows

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
            ax.plot(steps, values, marker="o" if "eval/" in key else None, markersize=3, label=key)
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
    parser.add_argument("metrics", nargs="+", help="a run's metrics.jsonl, or several as LABEL=PATH")
    parser.add_argument("--out", default=None, help="PNG path (default: reward_accuracy.png beside it)")
    parser.add_argument("--keys", nargs="+", default=DEFAULT_KEYS)
    parser.add_argument("--title", default="reward and accuracy per step")
    parser.add_argument(
        "--since",
        type=float,
        default=None,
        metavar="UNIX_TIME",
        help="print the held-out accuracy before and after, and the whole run's seconds since then",
    )
    args = parser.parse_args(argv)
    series: dict[str, list[tuple[int, float]]] = {}
    paths = []
    for given in args.metrics:
        label, _, path = (
            given.rpartition("=") if "=" in given and not os.path.isfile(given) else ("", "", given)
        )
        if not os.path.isfile(path):
            parser.error(f"{path!r}: no such file")
        try:
            run = read_series(path, args.keys)
        except ValueError as e:  # DataError: the file:line of a bad record
            parser.error(str(e))
        if not any(run.values()):
            parser.error(f"{path!r} has none of the keys {args.keys}")
        series.update({f"{label}: {k}" if label else k: v for k, v in run.items()})
        paths.append(path)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        parser.error("plotting needs matplotlib: pip install matplotlib (or pip install -e '.[demo]')")
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(paths[0])), "reward_accuracy.png")
    plot(series, out, args.title)
    print(out)
    if args.since is not None:
        print(accuracy_line(read_series(paths[0], ["eval/accuracy"])["eval/accuracy"], args.since))
    return 0


def accuracy_line(evals: list[tuple[int, float]], since: float) -> str:
    """The first and the last held-out accuracy of a run, and the seconds since `since`."""
    if not evals:
        return f"no eval/accuracy recorded; whole demo {time.time() - since:.0f} s"
    (first_step, first), (last_step, last) = evals[0], evals[-1]
    return (
        f"held-out accuracy: {first:.3f} at step {first_step} (before RL) -> {last:.3f} at step {last_step} "
        f"({100 * (last - first):+.1f} points); whole demo {time.time() - since:.0f} s"
    )


if __name__ == "__main__":
    sys.exit(main())
