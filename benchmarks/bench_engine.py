"""Torch engine throughput and memory against Hugging Face `generate`, on the tiny model.

    python benchmarks/bench_engine.py [--model-path DIR] [--threads 2] [--leak-requests 1000]

Workload: 64 requests, prompt lengths 8-64 and max_new_tokens 16-128 drawn with a fixed seed,
all submitted at once; every request generates exactly its max_new_tokens (ignore_eos), sampled
at temperature 1. Baseline, measured in the same run: `model.generate` on the same requests in
left-padded batches of 32 (each batch runs to its longest max_new_tokens; only the requested
tokens are counted). Also: torch-engine tokens/s at client concurrency 1, 8, 32, 64, and the
engine process RSS before and after --leak-requests requests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time

import psutil
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.engines.client import ClientConfig, EngineClient
from slime.engines.torch_engine.launcher import start_torch_engine
from slime.tools.make_tiny_model import main as make_tiny_model


def make_workload(n: int, seed: int, vocab: int, max_new=(16, 128), prompt=(8, 64)):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        length = rng.randint(*prompt)
        reqs.append(([rng.randrange(4, vocab) for _ in range(length)], rng.randint(*max_new)))
    return reqs


def bench_hf_generate(model_path: str, reqs, batch_size: int = 32) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model.eval()
    pad = model.config.pad_token_id or 0
    useful = sum(m for _, m in reqs)
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(batch):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=max(m for _, m in batch),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                eos_token_id=None,
                pad_token_id=pad,
                min_new_tokens=max(m for _, m in batch),
            )
    return useful / (time.perf_counter() - start)


async def run_engine(url: str, reqs, concurrency: int) -> tuple[float, int]:
    async with EngineClient(url, ClientConfig(max_concurrency=concurrency)) as c:
        start = time.perf_counter()
        results = await asyncio.gather(
            *[
                c.generate(
                    p,
                    sampling_params={"max_new_tokens": m, "temperature": 1.0, "ignore_eos": True},
                    return_logprob=True,
                )
                for p, m in reqs
            ]
        )
        elapsed = time.perf_counter() - start
    tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    assert tokens == sum(m for _, m in reqs), "engine generated a different number of tokens than requested"
    return tokens / elapsed, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: build the default tiny model in a temp dir")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--leak-requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="bench_engine_")
    model_path = args.model_path or os.path.join(tmp, "tiny")
    if not args.model_path:
        make_tiny_model(["--out", model_path])
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    reqs = make_workload(64, args.seed, vocab)
    rows = []

    engine = start_torch_engine(
        model_path, ["--num-threads", str(args.threads)], log_path=os.path.join(tmp, "engine.log")
    )
    try:
        asyncio.run(run_engine(engine.url, reqs[:8], 8))  # warm-up
        engine_tps, _ = asyncio.run(run_engine(engine.url, reqs, 64))
        sweep = {c: asyncio.run(run_engine(engine.url, reqs, c))[0] for c in (1, 8, 32, 64)}
        proc = psutil.Process(engine.proc.pid)
        rss_before = proc.memory_info().rss
        leak_reqs = make_workload(args.leak_requests, args.seed + 1, vocab, max_new=(4, 32))
        start = time.perf_counter()
        asyncio.run(run_engine(engine.url, leak_reqs, 64))
        leak_time = time.perf_counter() - start
        rss_after = proc.memory_info().rss
    finally:
        engine.stop()
    hf_tps = bench_hf_generate(model_path, reqs)

    ratio = engine_tps / hf_tps
    growth_mb = (rss_after - rss_before) / 2**20
    rows.append(("HF generate (padded batches of 32)", f"{hf_tps:,.0f}"))
    rows.append(("torch engine (64 at once)", f"{engine_tps:,.0f}"))
    for c, tps in sweep.items():
        rows.append((f"torch engine, concurrency {c}", f"{tps:,.0f}"))
    width = max(len(r[0]) for r in rows)
    print(
        f"\nworkload: 64 requests, prompt 8-64, max_new_tokens 16-128 (seed {args.seed}), "
        f"{sum(m for _, m in reqs)} tokens, {args.threads} threads"
    )
    print(f"{'configuration'.ljust(width)} | tokens/s")
    print(f"{'-' * width}-|---------")
    for name, value in rows:
        print(f"{name.ljust(width)} | {value:>8}")
    print(
        f"\nratio torch engine / HF generate: {ratio:.2f}x (target >= 1.5x: {'PASS' if ratio >= 1.5 else 'FAIL'})"
    )
    print(
        f"engine RSS: {rss_before / 2**20:.1f} MB before, {rss_after / 2**20:.1f} MB after "
        f"{args.leak_requests} requests ({leak_time:.1f} s); growth {growth_mb:+.1f} MB "
        f"(target < 50 MB: {'PASS' if growth_mb < 50 else 'FAIL'})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
