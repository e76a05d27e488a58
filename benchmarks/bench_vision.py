"""The torch engine serving a vision-language model (tiny Qwen3-VL, or Qwen3.5 with --arch
qwen3_5_vl) against Hugging Face `generate` on the same multimodal requests, measured in the same
run.

    python benchmarks/bench_vision.py [--arch qwen3_vl] [--requests 16] [--new-tokens 16]
        [--image-sizes 64,128] [--hidden-size 128] [--num-layers 4] [--threads 2]

For each image size, --requests prompts each carry one image of the vision task (dots on black,
every image different) and ask for --new-tokens greedy tokens (ignore_eos). The engine gets them
all at once as SGLang requests (`text` with the image placeholder, `image_data` as PNG data URLs:
it decodes, preprocesses and encodes each image); HF runs the processor and `generate` on one
request after another in this process (batch 1, the exact reference; the image and video
placeholders suppressed, as the engine never samples them). Reported: images/s and
output tokens/s of both, their ratio, and whether the engine's tokens equal HF's. An image of
64 pixels is 4 language-model tokens, of 128 pixels 16.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from slime.engines.client import EngineClient
from slime.engines.torch_engine.launcher import start_torch_engine
from slime.tools.make_tiny_model import main as make_tiny_model
from slime.tools.make_vision_task import draw_dots
from slime.utils.processing_utils import encode_image_for_rollout_engine, load_processor

TEXT = (
    "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many "
    "dots?<|im_end|>\n<|im_start|>assistant\n"
)
GREEDY = {"temperature": 0.0, "ignore_eos": True}


async def engine_run(url: str, images: list[str], new_tokens: int) -> tuple[float, list[list[int]]]:
    async with EngineClient(url) as client:
        await client.generate(
            text=TEXT, image_data=[images[0]], sampling_params={**GREEDY, "max_new_tokens": 2}
        )
        start = time.perf_counter()
        out = await client.generate(
            text=[TEXT] * len(images),
            image_data=[[u] for u in images],
            sampling_params={**GREEDY, "max_new_tokens": new_tokens},
        )
        return time.perf_counter() - start, [r["output_ids"] for r in out]


def hf_run(path: str, images: list, new_tokens: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = load_processor(path)
    outputs = []

    # the engine never samples the image and video placeholders: HF's generate leaves them out too
    placeholders = [model.config.image_token_id, model.config.video_token_id]

    def one(image, n):
        inputs = processor(text=[TEXT], images=[image], return_tensors="pt")
        out = model.generate(
            **inputs,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            suppress_tokens=placeholders,
        )
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    with torch.no_grad():
        one(images[0], 2)  # warm-up
        start = time.perf_counter()
        outputs = [one(image, new_tokens) for image in images]
        return time.perf_counter() - start, outputs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3_vl", choices=["qwen3_vl", "qwen3_5_vl", "qwen3_5_moe_vl"])
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--image-sizes", default="64,128", help="image widths in pixels, multiples of 32")
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "vlm")
        make_tiny_model(
            [
                "--out",
                path,
                "--arch",
                args.arch,
                "--hidden-size",
                str(args.hidden_size),
                "--num-layers",
                str(args.num_layers),
            ]
        )
        with start_torch_engine(
            path, ["--num-threads", str(args.threads)], log_path=os.path.join(tmp, "e.log")
        ) as eng:
            for size in (int(s) for s in args.image_sizes.split(",")):
                rng = random.Random(size)
                images = [draw_dots(1 + i % 4, size, rng) for i in range(args.requests)]
                urls = [encode_image_for_rollout_engine(image) for image in images]
                seconds, got = asyncio.run(engine_run(eng.url, urls, args.new_tokens))
                hf_seconds, want = hf_run(path, images, args.new_tokens)
                rows.append((size, seconds, hf_seconds, got == want))
    n, tokens = args.requests, args.requests * args.new_tokens
    print(
        f"\n{args.arch}: {n} requests of one image x {args.new_tokens} greedy tokens, hidden "
        f"{args.hidden_size}, {args.num_layers} layers, {args.threads} threads\n"
    )
    print(
        "| image | engine images/s | HF images/s | engine tok/s | HF generate tok/s | ratio | tokens "
        "equal HF's |"
    )
    print("|---|---|---|---|---|---|---|")
    for size, ours, theirs, same in rows:
        print(
            f"| {size}x{size} ({(size // 32) ** 2} tokens) | {n / ours:.1f} | {n / theirs:.1f} | "
            f"{tokens / ours:.0f} | {tokens / theirs:.0f} | {theirs / ours:.2f}x | "
            f"{'yes' if same else 'NO'} |"
        )
    return 0 if all(r[3] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
