"""The torch engine on each model family (docs/models.md) against Hugging Face `generate` on the
same requests, measured in the same run.

    python benchmarks/bench_families.py [--archs qwen3,glm4,...] [--requests 8] [--new-tokens 32]
        [--hidden-size 128] [--num-layers 4] [--threads 2]

For each `make_tiny_model --arch` (a fresh tiny checkpoint of --hidden-size / --num-layers), a
torch engine serves --requests greedy requests of --new-tokens tokens each (ignore_eos), all sent
at once, and Hugging Face's `generate` runs the same prompts one after the other in this process
(batch 1: transformers' padded batches change a hybrid model's linear-attention state, so one
sequence at a time is the exact reference). Reported per family: the engine's runner, its
output tokens/s, HF's, their ratio, and whether the engine's greedy tokens equal HF's. Each
family runs on the runner docs/models.md names for it (qwen3, the first row, on the batched one).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from slime.engines.client import EngineClient
from slime.engines.torch_engine.launcher import start_torch_engine
from slime.tools.make_tiny_model import main as make_tiny_model
from slime.tools.tiny_families import NEW_FAMILIES

GREEDY = {"temperature": 0.0, "ignore_eos": True}


def prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [
        torch.randint(5, 100, (int(torch.randint(4, 16, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


async def engine_run(url: str, batch: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]], str]:
    async with EngineClient(url) as client:
        runner = (await client.get_server_info())["runner"]
        await client.generate([batch[0]], sampling_params={**GREEDY, "max_new_tokens": 2})  # warm-up
        start = time.perf_counter()
        out = await client.generate(batch, sampling_params={**GREEDY, "max_new_tokens": new_tokens})
        return time.perf_counter() - start, [r["output_ids"] for r in out], runner


def hf_run(path: str, batch: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        model.generate(torch.tensor([batch[0]]), max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        start = time.perf_counter()
        for p in batch:
            out = model.generate(
                torch.tensor([p]),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outputs.append(out[0, len(p) :].tolist())
        return time.perf_counter() - start, outputs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", default=",".join(("qwen3", *NEW_FAMILIES)))
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    batch = prompts(args.requests)
    tokens = args.requests * args.new_tokens
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            path = os.path.join(tmp, arch)
            make_tiny_model(
                [
                    "--out",
                    path,
                    "--arch",
                    arch,
                    "--hidden-size",
                    str(args.hidden_size),
                    "--num-layers",
                    str(args.num_layers),
                ]
            )
            with start_torch_engine(
                path, ["--num-threads", str(args.threads)], log_path=os.path.join(tmp, f"{arch}.log")
            ) as eng:
                seconds, got, runner = asyncio.run(engine_run(eng.url, batch, args.new_tokens))
            hf_seconds, want = hf_run(path, batch, args.new_tokens)
            rows.append((arch, runner, tokens / seconds, tokens / hf_seconds, got == want))
    print(
        f"\n{args.requests} greedy requests x {args.new_tokens} tokens, hidden {args.hidden_size}, "
        f"{args.num_layers} layers, {args.threads} threads\n"
    )
    print("| arch | engine runner | engine tok/s | HF generate tok/s | ratio | tokens equal HF's |")
    print("|---|---|---|---|---|---|")
    for arch, runner, ours, theirs, same in rows:
        print(
            f"| {arch} | {runner} | {ours:.0f} | {theirs:.0f} | {ours / theirs:.2f}x | "
            f"{'yes' if same else 'NO'} |"
        )
    return 0 if all(r[4] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
