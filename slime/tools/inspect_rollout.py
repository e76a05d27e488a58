"""Look inside rollout dumps (`--save-debug-rollout-data`): a summary, one sample, or a diff.

    python -m slime.tools.inspect_rollout FILE                  summary of the rollout
    python -m slime.tools.inspect_rollout FILE --sample N       sample N, token by token
    python -m slime.tools.inspect_rollout FILE --diff OTHER     sample-by-sample comparison
    ... [--json] [--tokenizer DIR]

The summary gives the number of samples and groups, the reward distribution, response lengths,
status counts, weight versions and engine log-prob statistics. `--sample` decodes one sample's
response tokens with their log-probs and loss mask (the tokenizer comes from `--tokenizer`, else
the `--hf-checkpoint` recorded in the dump). `--diff` names, for each sample that differs, the
first field that differs and, for token lists, the first differing position; it exits 1 when
the dumps differ, like diff(1). `--json` prints the same as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import Counter
from typing import Any

from slime.rollout.dump import DumpError, load_dump

DIFF_FIELDS = (
    "prompt",
    "tokens",
    "response_length",
    "response",
    "label",
    "reward",
    "loss_mask",
    "rollout_log_probs",
    "status",
    "weight_versions",
    "group_index",
)


def _scalar(reward: Any) -> float | None:
    if isinstance(reward, int | float) and not isinstance(reward, bool):
        return float(reward)
    return None


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(values),
        "min": ordered[0],
        "p50": ordered[len(ordered) // 2],
        "max": ordered[-1],
    }


def _versions(sample: dict[str, Any]) -> list[Any]:
    """The weight versions of a sample (version 1 dumps hold one `weight_version`)."""
    if "weight_versions" in sample:
        return list(sample["weight_versions"] or [None])
    return [sample.get("weight_version")]


def _short(value: Any) -> Any:
    return value[:16] + "…" if isinstance(value, str) and len(value) > 16 else value


def summarize(dump: dict[str, Any]) -> dict[str, Any]:
    samples = dump["samples"]
    rewards = [r for r in (_scalar(s.get("reward")) for s in samples) if r is not None]
    log_probs = [lp for s in samples for lp in (s.get("rollout_log_probs") or [])]
    distinct = Counter(rewards)
    counts = {"counts": {str(k): v for k, v in sorted(distinct.items())}} if len(distinct) <= 10 else {}
    return {
        "rollout_id": dump["rollout_id"],
        "format_version": dump["format_version"],
        "samples": len(samples),
        "groups": len({s.get("group_index") for s in samples}),
        "reward": {**_stats(rewards), **counts},
        "dict_rewards": sum(isinstance(s.get("reward"), dict) for s in samples),
        "response_length": _stats([float(s.get("response_length", 0)) for s in samples]),
        "status": dict(Counter(str(s.get("status")) for s in samples)),
        "weight_versions": dict(Counter(str(v) for s in samples for v in _versions(s))),
        "rollout_log_probs": {
            **_stats(log_probs),
            "tokens": len(log_probs),
            "non_finite": sum(not math.isfinite(x) for x in log_probs),
        },
        "meta": {k: _short(v) for k, v in dump["meta"].items() if k != "flags"},
        "flags": dump["meta"].get("flags", {}),
    }


def sample_view(dump: dict[str, Any], n: int, tokenizer: Any) -> dict[str, Any]:
    samples = dump["samples"]
    if not 0 <= n < len(samples):
        raise IndexError(f"--sample {n}: the dump holds samples 0..{len(samples) - 1}")
    s = samples[n]
    length = int(s.get("response_length", 0))
    response_ids = list(s.get("tokens", []))[len(s.get("tokens", [])) - length :] if length else []
    log_probs = s.get("rollout_log_probs") or [None] * length
    mask = s.get("loss_mask") or [1] * length
    tokens = [
        {
            "position": i,
            "id": t,
            "text": tokenizer.decode([t]) if tokenizer is not None else None,
            "log_prob": log_probs[i] if i < len(log_probs) else None,
            "loss_mask": mask[i] if i < len(mask) else None,
        }
        for i, t in enumerate(response_ids)
    ]
    keys = (
        "index",
        "group_index",
        "prompt",
        "response",
        "label",
        "reward",
        "status",
        "weight_versions",
        "metadata",
    )
    return {
        **{k: s.get(k) for k in keys},
        "weight_versions": _versions(s),
        "prompt_tokens": len(s.get("tokens", [])) - length,
        "response_tokens": tokens,
    }


def _first_difference(a: Any, b: Any) -> str | None:
    if a == b:
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"position {i}: {x!r} != {y!r}"
        return f"lengths {len(a)} != {len(b)} (equal up to position {min(len(a), len(b))})"
    return f"{a!r} != {b!r}"


def diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    sa, sb = a["samples"], b["samples"]
    differences = []
    for i in range(min(len(sa), len(sb))):
        for field in DIFF_FIELDS:
            where = _first_difference(sa[i].get(field), sb[i].get(field))
            if where is not None:
                differences.append({"sample": i, "field": field, "first_difference": where})
                break
    return {
        "samples": [len(sa), len(sb)],
        "identical": not differences and len(sa) == len(sb),
        "differing_samples": len(differences),
        "differences": differences,
    }


def _load_tokenizer(path: str | None) -> Any:
    if not path:
        return None
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # decoding is a convenience: show ids without it
        print(f"(no tokenizer from {path!r}: {e}; showing token ids only)", file=sys.stderr)
        return None


def _print_summary(s: dict[str, Any]) -> None:
    print(
        f"rollout {s['rollout_id']} (format {s['format_version']}): {s['samples']} samples in "
        f"{s['groups']} groups"
    )
    r = s["reward"]
    if r:
        counts = f"  counts {r['counts']}" if "counts" in r else ""
        print(
            f"reward: mean {r['mean']:.4f}  min {r['min']:.4g}  p50 {r['p50']:.4g}  max "
            f"{r['max']:.4g}{counts}"
        )
    if s["dict_rewards"]:
        print(f"dict rewards: {s['dict_rewards']} samples")
    L = s["response_length"]
    print(
        f"response length: mean {L['mean']:.2f}  min {L['min']:.0f}  p50 {L['p50']:.0f}  max {L['max']:.0f}"
    )
    print(f"status: {s['status']}")
    print(f"weight versions: {s['weight_versions']}")
    lp = s["rollout_log_probs"]
    if lp.get("tokens"):
        print(
            f"rollout log-probs: {lp['tokens']} tokens, mean {lp['mean']:.4f}  min {lp['min']:.4f}  "
            f"max {lp['max']:.4f}  non-finite {lp['non_finite']}"
        )
    print(f"meta: {s['meta']}")


def _print_sample(v: dict[str, Any]) -> None:
    print(
        f"sample {v['index']} (group {v['group_index']}), status {v['status']}, weight_versions "
        f"{v['weight_versions']}"
    )
    print(f"prompt ({v['prompt_tokens']} tokens): {v['prompt']!r}")
    print(f"response: {v['response']!r}")
    print(f"label: {v['label']!r}  reward: {v['reward']!r}")
    print(f"{'pos':>4} {'id':>7}  {'token':<16} {'log_prob':>10}  mask")
    for t in v["response_tokens"]:
        lp = "" if t["log_prob"] is None else f"{t['log_prob']:.5f}"
        text = "" if t["text"] is None else repr(t["text"])
        print(f"{t['position']:>4} {t['id']:>7}  {text:<16} {lp:>10}  {t['loss_mask']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slime.tools.inspect_rollout",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("file", help="a rollout dump (.pt)")
    parser.add_argument("--sample", type=int, default=None, metavar="N", help="show sample N token by token")
    parser.add_argument("--diff", default=None, metavar="OTHER", help="compare with another dump")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--tokenizer", default=None, help="tokenizer directory (default: the dump's --hf-checkpoint)"
    )
    args = parser.parse_args(argv)
    if args.sample is not None and args.diff is not None:
        parser.error("give --sample or --diff, not both")
    try:
        dump = load_dump(args.file, "inspect_rollout")
        other = load_dump(args.diff, "inspect_rollout --diff") if args.diff else None
    except DumpError as e:
        parser.error(str(e))
    if other is not None:
        result = diff(dump, other)
        if args.json:
            print(json.dumps(result))
        else:
            print(f"{args.file}: {result['samples'][0]} samples, {args.diff}: {result['samples'][1]} samples")
            for d in result["differences"]:
                print(f"sample {d['sample']}: {d['field']} differs at {d['first_difference']}")
            print("identical" if result["identical"] else f"{result['differing_samples']} samples differ")
        return 0 if result["identical"] else 1
    if args.sample is not None:
        tokenizer = _load_tokenizer(args.tokenizer or dump["meta"].get("flags", {}).get("hf_checkpoint"))
        try:
            view = sample_view(dump, args.sample, tokenizer)
        except IndexError as e:
            parser.error(str(e))
        print(json.dumps(view)) if args.json else _print_sample(view)
        return 0
    summary = summarize(dump)
    print(json.dumps(summary)) if args.json else _print_summary(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
