"""Write the vision demo's verifiable task: count the dots in a small generated image.

    python -m slime.tools.make_vision_task --out DIR [--max-dots 4] [--size 64]
        [--train-size 2000] [--eval-size 200] [--sft-size 300] [--seed 0]

Each image is `--size` pixels square, black, with 1 to `--max-dots` white dots: filled circles of
random radius, each somewhere in its own 32-pixel cell of the image (the area one language-model
token of the tiny Qwen3-VL sees), the cells chosen at random. The prompt asks for the count:

    DIR/images/000123.png
    DIR/train.jsonl  {"prompt": "<image>How many dots?", "images": [".../000123.png"], "label": "3"}
    DIR/eval.jsonl   held out: images of their own, evaluation only
    DIR/sft.jsonl    {"prompt": ..., "images": [...], "response": "3"}  the warm start: part of train

Read it with `--multimodal-keys '{"image": "images"}' --apply-chat-template --rm-type exact`. The
image paths are absolute. The same arguments give the same bytes; files are written into a
temporary directory beside DIR and renamed into place when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from typing import Any

from slime.utils.files import staged_directory

PROMPT = "<image>How many dots?"


CELL = 32  # pixels: one language-model token of the tiny Qwen3-VL (2 x 2 patches of 16)


def draw_dots(count: int, size: int, rng: random.Random) -> Any:
    """A black `size` x `size` RGB image with `count` white dots of random size, each in its own
    cell of a grid of CELL-pixel cells (chosen at random), placed at random within it."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size))
    draw = ImageDraw.Draw(image)
    per_side = size // CELL
    for cell in rng.sample(range(per_side * per_side), count):
        r = rng.uniform(CELL / 8, CELL / 4)
        cx, cy = (cell % per_side) * CELL, (cell // per_side) * CELL
        x, y = cx + rng.uniform(r + 1, CELL - r - 1), cy + rng.uniform(r + 1, CELL - r - 1)
        draw.ellipse((x - r, y - r, x + r, y + r), fill=(255, 255, 255))
    return image


def write_task(
    out: str, max_dots: int, size: int, train_size: int, eval_size: int, sft_size: int, seed: int
) -> None:
    rng = random.Random(seed)
    final = os.path.abspath(out)  # the rows name the images where they will be
    with staged_directory(out) as staging:
        os.makedirs(os.path.join(staging, "images"))
        rows: list[dict[str, Any]] = []
        for i in range(train_size + eval_size):
            count = rng.randint(1, max_dots)
            name = f"{i:06d}.png"
            draw_dots(count, size, rng).save(os.path.join(staging, "images", name), format="PNG")
            rows.append(
                {"prompt": PROMPT, "images": [os.path.join(final, "images", name)], "label": str(count)}
            )
        train, held_out = rows[:train_size], rows[train_size:]
        sft = [
            {"prompt": r["prompt"], "images": r["images"], "response": r["label"]} for r in train[:sft_size]
        ]
        for name, part in (("train", train), ("eval", held_out), ("sft", sft)):
            with open(os.path.join(staging, f"{name}.jsonl"), "w") as f:
                f.writelines(json.dumps(row) + "\n" for row in part)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m slime.tools.make_vision_task",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="output directory (replaced if it exists)")
    parser.add_argument("--max-dots", type=int, default=4)
    parser.add_argument("--size", type=int, default=64, help="image width and height in pixels")
    parser.add_argument("--train-size", type=int, default=2000)
    parser.add_argument("--eval-size", type=int, default=200)
    parser.add_argument("--sft-size", type=int, default=300, help="training rows also written as sft.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 1 <= args.max_dots <= 9:
        parser.error("--max-dots must be between 1 and 9 (the answer is one digit)")
    if args.size < CELL or args.size % CELL:
        parser.error(f"--size must be a multiple of {CELL} pixels")
    if args.max_dots > (args.size // CELL) ** 2:
        parser.error(
            f"--max-dots {args.max_dots}: a {args.size}-pixel image has {(args.size // CELL) ** 2} cells of "
            f"{CELL} pixels, one dot each (raise --size)"
        )
    if args.train_size < 1 or args.eval_size < 0 or not 0 <= args.sft_size <= args.train_size:
        parser.error("--train-size must be >= 1, --eval-size >= 0, and --sft-size within --train-size")
    write_task(args.out, args.max_dots, args.size, args.train_size, args.eval_size, args.sft_size, args.seed)
    sys.stdout.write(
        json.dumps(
            {
                "out": os.path.abspath(args.out),
                "train": args.train_size,
                "eval": args.eval_size,
                "sft": args.sft_size,
            }
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
