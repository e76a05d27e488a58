"""What --deterministic-mode costs: engine, trainer and the whole loop, each against the
default mode measured in the same run.

    python benchmarks/bench_deterministic.py [--threads 2] [--num-rollout 20] [--out DIR]

1. Engine: bench_engine.py's workload (64 requests, prompt 8-64, 16-128 new tokens, sampled at
   temperature 1, each with its own sampling_seed) at client concurrency 1, 8 and 64, with and
   without --enable-deterministic-inference; plus whether the log-probs at concurrency 64 equal
   those at concurrency 1 bit for bit (what the mode buys).
2. Trainer: the FSDP actor (one rank) on bench_train.py's rollouts, with and without
   torch.use_deterministic_algorithms and the seeding of slime.utils.seed.
3. Loop: train.py on the demo workload (bench_loop.py's flags), with and without
   --deterministic-mode; steps per minute after 3 warm-up steps.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_engine import make_workload
from benchmarks.bench_loop import make_demo, run, summarize
from benchmarks.bench_train import make_rollout
from slime.engines.client import ClientConfig, EngineClient
from slime.engines.torch_engine.launcher import start_torch_engine
from slime.tools.make_tiny_model import main as make_tiny_model


async def generate_all(url: str, reqs, concurrency: int) -> tuple[float, list[list[float]]]:
    async with EngineClient(url, ClientConfig(max_concurrency=concurrency)) as c:
        start = time.perf_counter()
        results = await asyncio.gather(
            *[
                c.generate(
                    p,
                    sampling_params={
                        "max_new_tokens": m,
                        "temperature": 1.0,
                        "ignore_eos": True,
                        "sampling_seed": 1000 + i,
                    },
                    return_logprob=True,
                )
                for i, (p, m) in enumerate(reqs)
            ]
        )
        elapsed = time.perf_counter() - start
    tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    return tokens / elapsed, [[x[0] for x in r["meta_info"]["output_token_logprobs"]] for r in results]


def bench_engine(model: str, threads: int, tmp: str) -> dict[str, dict]:
    vocab = 101
    reqs = make_workload(64, 1234, vocab)
    out: dict[str, dict] = {}
    for mode, extra in (("default", []), ("deterministic", ["--enable-deterministic-inference"])):
        engine = start_torch_engine(
            model, ["--num-threads", str(threads), *extra], log_path=os.path.join(tmp, f"engine-{mode}.log")
        )
        try:
            asyncio.run(generate_all(engine.url, reqs[:8], 8))  # warm-up
            rates, logprobs = {}, {}
            for c in (1, 8, 64):
                rates[c], logprobs[c] = asyncio.run(generate_all(engine.url, reqs, c))
        finally:
            engine.stop()
        out[mode] = {"rates": rates, "invariant": logprobs[64] == logprobs[1]}
    return out


def bench_trainer(model: str, tmp: str, rollouts: int = 3) -> dict[str, float]:
    import statistics

    from slime.backends.fsdp.actor import FSDPTrainActor
    from slime.config.train import BatchConfig, OptimizerConfig, TrainConfig

    out = {}
    # Deterministic last: torch.use_deterministic_algorithms is process-wide.
    for mode, deterministic in (("default", False), ("deterministic", True)):
        cfg = TrainConfig(
            hf_checkpoint=model,
            deterministic=deterministic,
            optimizer=OptimizerConfig(lr=1e-5),
            batch=BatchConfig(global_batch_size=32, micro_batch_size=8),
        )
        actor = FSDPTrainActor(cfg, 0, 1, f"file://{os.path.join(tmp, 'rdzv-' + mode)}")
        actor.init()
        tokens = sum(len(t) for t in make_rollout(0, 101).tokens)
        actor.train(0, make_rollout(100, 101))  # warm-up
        rates = []
        for r in range(rollouts):
            batch = make_rollout(r, 101)
            start = time.perf_counter()
            actor.train(r + 1, batch)
            rates.append(tokens / (time.perf_counter() - start))
        actor.close()
        out[mode] = statistics.median(rates)
    torch.use_deterministic_algorithms(False)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--num-rollout", type=int, default=20, help="at least 4: the first 3 are the warm-up")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.num_rollout < 4:
        parser.error(
            "--num-rollout must be at least 4 (the first 3 rollouts are the warm-up, left out of the means)"
        )
    torch.set_num_threads(args.threads)
    out = args.out or tempfile.mkdtemp(prefix="bench-deterministic-")
    tiny = os.path.join(out, "tiny")
    make_tiny_model(["--out", tiny])

    engine = bench_engine(tiny, args.threads, out)
    print(f"1. torch engine, 64 requests, {args.threads} threads: tokens/s")
    print(f"{'concurrency':<14}{'default':>12}{'deterministic':>16}{'ratio':>8}")
    for c in (1, 8, 64):
        d, x = engine["default"]["rates"][c], engine["deterministic"]["rates"][c]
        print(f"{c:<14}{d:>12,.0f}{x:>16,.0f}{x / d:>8.2f}")
    print(
        f"log-probs at concurrency 64 == at concurrency 1, bit for bit: default "
        f"{engine['default']['invariant']}, deterministic {engine['deterministic']['invariant']}"
    )

    train = bench_trainer(tiny, out)
    print(
        f"\n2. FSDP actor, 1 rank: tokens/s (median of 3 rollouts)\n{'default':<14}{train['default']:>12,.0f}"
    )
    print(
        f"{'deterministic':<14}{train['deterministic']:>12,.0f}  ratio "
        f"{train['deterministic'] / train['default']:.2f}"
    )

    model, task = make_demo(out)
    loops = {
        mode: summarize(run("train.py", out, model, task, args.num_rollout, extra, tag="-" + mode), 3)
        for mode, extra in (("default", ()), ("deterministic", ("--deterministic-mode",)))
    }
    d, x = loops["default"], loops["deterministic"]
    print(f"\n3. train.py, demo workload, {args.num_rollout} rollouts (means after 3 steps)")
    print(f"{'':<14}{'steps/min':>10}{'generate s':>12}{'train s':>10}")
    for mode, r in loops.items():
        print(f"{mode:<14}{r['steps_per_min']:>10.1f}{r['generate']:>12.3f}{r['train']:>10.3f}")
    print(f"deterministic / default = {x['steps_per_min'] / d['steps_per_min']:.2f}x steps per minute")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
