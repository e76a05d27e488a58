"""Recompute trainer-side log-probs for a saved rollout and compare them with the engine's.

    python -m slime.tools.check_logprob_precision --hf-checkpoint DIR --rollout-data FILE
        [--rollout-temperature T] [--tol X] [--worst 5] [--json]

No engine is started: the FSDP train actor (one CPU rank) computes the log-prob of every response
token of the dump (`--save-debug-rollout-data`) exactly as training would, and the tool reports
|trainer − engine| over the loss mask: mean, max, the worst samples with the token position of
their largest gap, and a histogram. With `--tol`, the exit code is 1 when the max exceeds it.
The temperature defaults to the dump's `--rollout-temperature` (1.0 for greedy rollouts).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from typing import Any

BUCKETS = (1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)


def compare(samples: list[dict[str, Any]], trainer: dict[int, list[float]], worst: int) -> dict[str, Any]:
    """Per-token |trainer − engine| statistics over each sample's loss mask."""
    diffs: list[float] = []
    per_sample = []
    for s in samples:
        engine = s.get("rollout_log_probs")
        if not engine:
            continue
        mask = s.get("loss_mask") or [1] * len(engine)
        gaps = [abs(t - e) for t, e, m in zip(trainer[s["index"]], engine, mask) if m]
        if not gaps:
            continue
        diffs.extend(gaps)
        top = max(range(len(gaps)), key=gaps.__getitem__)
        per_sample.append(
            {
                "sample": s["index"],
                "max_abs_diff": gaps[top],
                "position": top,
                "mean_abs_diff": sum(gaps) / len(gaps),
            }
        )
    if not diffs:
        raise ValueError("the dump has no engine log-probs (rollout_log_probs) to compare with")
    histogram = {
        f"<{b:g}": sum(d < b for d in diffs) - sum(d < p for d in diffs)
        for p, b in zip((0.0, *BUCKETS), BUCKETS)
    }
    histogram[f">={BUCKETS[-1]:g}"] = sum(d >= BUCKETS[-1] for d in diffs)
    per_sample.sort(key=lambda r: -r["max_abs_diff"])
    return {
        "samples": len(per_sample),
        "tokens": len(diffs),
        "mean_abs_diff": sum(diffs) / len(diffs),
        "max_abs_diff": max(diffs),
        "worst_samples": per_sample[:worst],
        "histogram": histogram,
    }


def trainer_log_probs(
    hf_checkpoint: str, samples: list[dict[str, Any]], temperature: float
) -> dict[int, list[float]]:
    from slime.backends.fsdp.actor import FSDPTrainActor
    from slime.config.train import TrainConfig
    from slime.utils.sample import Sample, samples_to_batch

    batch = samples_to_batch([Sample.from_dict(s) for s in samples])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    actor = FSDPTrainActor(
        TrainConfig(hf_checkpoint=hf_checkpoint, rollout_temperature=temperature),
        0,
        1,
        f"tcp://127.0.0.1:{port}",
    )
    actor.init()
    try:
        return actor.compute_log_probs(batch)
    finally:
        actor.close()


def main(argv: list[str] | None = None) -> int:
    from slime.rollout.dump import DumpError, load_dump

    parser = argparse.ArgumentParser(
        prog="python -m slime.tools.check_logprob_precision",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--hf-checkpoint", required=True, help="the weights the engine generated with")
    parser.add_argument("--rollout-data", required=True, help="a rollout dump (--save-debug-rollout-data)")
    parser.add_argument("--rollout-temperature", type=float, default=None)
    parser.add_argument("--tol", type=float, default=None, help="exit 1 when max |diff| exceeds this")
    parser.add_argument("--worst", type=int, default=5, help="how many worst samples to list")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        dump = load_dump(args.rollout_data, "--rollout-data")
    except DumpError as e:
        parser.error(str(e))
    temperature = args.rollout_temperature
    if temperature is None:
        temperature = dump["meta"].get("flags", {}).get("rollout_temperature") or 1.0
    if temperature <= 0:
        parser.error(f"--rollout-temperature must be > 0, got {temperature}")
    try:
        report = compare(
            dump["samples"], trainer_log_probs(args.hf_checkpoint, dump["samples"], temperature), args.worst
        )
    except ValueError as e:
        parser.error(f"--rollout-data {args.rollout_data!r}: {e}")
    report["temperature"] = temperature
    if args.json:
        print(json.dumps(report))
    else:
        print(f"{report['samples']} samples, {report['tokens']} response tokens, temperature {temperature:g}")
        print(
            f"|trainer - engine| log-prob: mean {report['mean_abs_diff']:.3e}  max "
            f"{report['max_abs_diff']:.3e}"
        )
        for w in report["worst_samples"]:
            print(
                f"  sample {w['sample']}: max {w['max_abs_diff']:.3e} at response token {w['position']}, "
                f"mean {w['mean_abs_diff']:.3e}"
            )
        print("histogram: " + "  ".join(f"{k}: {v}" for k, v in report["histogram"].items()))
    if args.tol is not None and report["max_abs_diff"] > args.tol:
        print(f"max |diff| {report['max_abs_diff']:.3e} exceeds --tol {args.tol:g}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
