"""Write the demo's verifiable task: small-integer addition, as jsonl prompt/label files.

    python -m slime.tools.make_demo_task --out DIR [--max-a 99] [--max-b 9]
        [--eval-size 200] [--sft-size 300] [--seed 0]

Every problem "a+b=" with 0 <= a <= max_a and 0 <= b <= max_b is either held out for
evaluation or a training problem, never both:

    DIR/eval.jsonl   {"prompt": "23+4=", "label": "27"}     held out: evaluation only
    DIR/train.jsonl  {"prompt": "23+4=", "label": "27"}     the RL prompts: every other problem
    DIR/sft.jsonl    {"prompt": "23+4=", "response": "27"}  the warm start: a subset of train

The reward is `--rm-type exact` (the response, stripped, equals the label). The files are
written atomically; the same arguments give the same bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile


def problems(max_a: int, max_b: int) -> list[tuple[str, str]]:
    return [(f"{a}+{b}=", str(a + b)) for a in range(max_a + 1) for b in range(max_b + 1)]


def split(
    items: list[tuple[str, str]], eval_size: int, sft_size: int, seed: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]], list[tuple[str, str]]]:
    """(eval, sft, train) from a seeded shuffle: eval and train are disjoint, sft is part of train."""
    order = list(items)
    random.Random(seed).shuffle(order)
    return order[:eval_size], order[eval_size : eval_size + sft_size], order[eval_size:]


def _write_jsonl(path: str, rows: list[dict[str, str]]) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slime.tools.make_demo_task",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="output directory (created)")
    parser.add_argument("--max-a", type=int, default=99)
    parser.add_argument("--max-b", type=int, default=9)
    parser.add_argument("--eval-size", type=int, default=200, help="held-out evaluation problems")
    parser.add_argument("--sft-size", type=int, default=300, help="train problems also given as SFT examples")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_a < 0 or args.max_b < 0:
        parser.error("--max-a and --max-b must be >= 0")
    items = problems(args.max_a, args.max_b)
    if args.eval_size < 1 or args.sft_size < 0 or args.eval_size + args.sft_size > len(items):
        parser.error(
            f"--eval-size {args.eval_size} + --sft-size {args.sft_size} is more than the {len(items)} "
            "problems there are (raise --max-a/--max-b or lower the sizes)"
        )
    held_out, sft, train = split(items, args.eval_size, args.sft_size, args.seed)
    os.makedirs(args.out, exist_ok=True)
    _write_jsonl(os.path.join(args.out, "eval.jsonl"), [{"prompt": p, "label": a} for p, a in held_out])
    _write_jsonl(os.path.join(args.out, "sft.jsonl"), [{"prompt": p, "response": a} for p, a in sft])
    _write_jsonl(os.path.join(args.out, "train.jsonl"), [{"prompt": p, "label": a} for p, a in train])
    print(
        f"wrote {args.out}: {len(train)} train problems ({len(sft)} of them as SFT examples), "
        f"{len(held_out)} held-out eval problems",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
