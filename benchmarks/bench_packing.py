"""Packed against padded micro-batches: tokens/s of training (log-prob pass + optimizer steps) and
the peak memory of the rank, for both train backends, in the same run.

    python benchmarks/bench_packing.py [--backends fsdp,megatron] [--repeats 2] [--rounds 1] [--samples 40]

Workloads (fixed seeds; prompts 16-48 tokens): - long-tail: responses with a median of 64 tokens (32-96) and
one sample in ten 8x longer (512); - equal: every sample a 32-token prompt and a 64-token response (nothing to
pad). Micro-batches: `fixed` (--micro-batch-size 8, in rollout order) and `budget` (--use-dynamic-batch-size
--max-tokens-per-gpu 2048: real tokens when packed, padded size when padded). Each configuration runs in a
fresh process with one train rank (so `ru_maxrss` is that configuration's peak) on a 6-layer, 384-wide Qwen3
built locally (vocabulary 4,096), the trainer's full work per rollout: `actor.train` (its log-prob pass, GRPO
loss, AdamW), after one warm-up rollout.

A second table measures --log-probs-chunk-size: the same model with a 32,768-token vocabulary,
token-budget micro-batches of 4096 tokens, log-softmax over all tokens at once against chunks of
256; the peak RSS after a log-prob pass alone (a fresh process: model + that pass) and after training.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NUM_LAYERS, HIDDEN = "6", "384"


def make_rollout(workload: str, seed: int, samples: int):
    import torch

    from slime.utils.rollout_batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    long = set(torch.randperm(samples, generator=g)[: samples // 10].tolist())
    tokens, resp, rewards = [], [], []
    for i in range(samples):
        if workload == "equal":
            p, r = 32, 64
        else:
            p = int(torch.randint(16, 49, (1,), generator=g))
            r = 512 if i in long else int(torch.randint(32, 97, (1,), generator=g))
        tokens.append(torch.randint(4, 90, (p + r,), generator=g).tolist())
        resp.append(r)
        rewards.append(float(torch.rand((), generator=g) > 0.5))
    return RolloutBatch(tokens, resp, rewards, [i // 4 for i in range(samples)])


def child(spec: dict) -> dict:
    """One configuration, one train rank, in this process."""
    import torch

    from slime.algo.objective import LossConfig
    from slime.backends import make_train_actor
    from slime.config.train import BatchConfig, MegatronConfig, OptimizerConfig, TrainConfig
    from slime.utils import step_plans

    torch.set_num_threads(spec["threads"])
    if spec["batching"] == "fixed":
        batch_cfg = BatchConfig(micro_batch_size=8)
    else:
        batch_cfg = BatchConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=spec["budget"])
    batch_cfg = dataclasses.replace(
        batch_cfg, padded_micro_batches=spec["padded"], log_probs_chunk_size=spec["chunk"]
    )
    cfg = TrainConfig(
        hf_checkpoint=spec["model"],
        backend=spec["backend"],
        megatron=MegatronConfig(),
        loss=LossConfig(),
        optimizer=OptimizerConfig(lr=1e-5),
        batch=batch_cfg,
    )
    actor = make_train_actor(cfg, 0, 1, f"file://{spec['rendezvous']}")
    actor.init()
    actor.compute_log_probs(make_rollout(spec["workload"], 0, spec["samples"]))  # a log-prob pass alone first
    log_prob_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rates, padded_sizes = [], []
    for r in range(spec["repeats"] + 1):  # rollout 0 warms up
        batch = make_rollout(spec["workload"], r, spec["samples"])
        real = sum(len(t) for t in batch.tokens)
        lengths = [len(t) for t in batch.tokens]
        plan = actor.plan(batch)
        padded_sizes.append(
            sum(step_plans.padded_tokens(mb, lengths) for s in plan for mb in s.micro_batches) / real
        )
        start = time.perf_counter()
        actor.train(r, batch)
        if r:
            rates.append(real / (time.perf_counter() - start))
    actor.close()
    return {
        "tokens_per_s": statistics.median(rates),
        "runs": rates,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "log_prob_peak_rss": log_prob_peak,
        "padded_over_real": statistics.mean(padded_sizes),
    }


def run_child(spec: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"]), "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode:
        raise SystemExit(f"configuration {spec} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def build_models(tmp: str) -> tuple[str, str]:
    from slime.tools.make_tiny_model import main as make_tiny_model

    small, wide = os.path.join(tmp, "model"), os.path.join(tmp, "model-wide-vocab")
    common = ["--hidden-size", HIDDEN, "--num-layers", NUM_LAYERS, "--num-heads", "6", "--num-kv-heads", "2"]
    make_tiny_model(
        ["--out", small, *common, "--vocab", "4096"]
    )  # the output layer ~13% of the FLOPs, as in LLMs
    make_tiny_model(["--out", wide, *common, "--vocab", "32768"])
    return small, wide


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--backends", default="fsdp,megatron")
    parser.add_argument("--workloads", default="long-tail,equal")
    parser.add_argument("--batchings", default="fixed,budget")
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=2, help="measured rollouts after the warm-up")
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="processes per layout, alternating; the table shows each layout's fastest",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-chunks", action="store_true", help="skip the --log-probs-chunk-size table")
    args = parser.parse_args()
    if args.samples % 8:
        parser.error("--samples must be a multiple of 8 (--micro-batch-size 8 over one data-parallel rank)")
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    tmp = tempfile.mkdtemp(prefix="bench-packing-")
    small, wide = build_models(tmp)
    base = {
        "threads": args.threads,
        "repeats": args.repeats,
        "samples": args.samples,
        "chunk": -1,
        "budget": 2048,
    }
    counter = iter(range(1000))

    def measure(**spec: object) -> dict:
        full = {**base, **spec, "rendezvous": os.path.join(tmp, f"rdv{next(counter)}")}
        return run_child(full)

    print(
        f"model: Qwen3 {NUM_LAYERS} layers x {HIDDEN}, {args.samples} samples per rollout, threads "
        f"{args.threads}, median of {args.repeats} rollouts, fastest of {args.rounds} process(es) per "
        "layout"
    )
    print(
        f"{'backend':<9}{'micro-batches':<15}{'workload':<11}{'padded/real':>12}{'padded tok/s':>14}"
        f"{'packed tok/s':>14}{'packed/padded':>15}{'peak GiB pad/pack':>19}"
    )
    for backend in args.backends.split(","):
        for batching_mode in args.batchings.split(","):
            for workload in args.workloads.split(","):
                runs: dict[bool, list[dict]] = {True: [], False: []}
                for _ in range(args.rounds):  # padded and packed processes alternate
                    for padded in (True, False):
                        runs[padded].append(
                            measure(
                                model=small,
                                backend=backend,
                                batching=batching_mode,
                                workload=workload,
                                padded=padded,
                            )
                        )
                # the least disturbed process of each layout (this machine is shared)
                pad, pack = (max(runs[p], key=lambda r: r["tokens_per_s"]) for p in (True, False))
                print(
                    f"{backend:<9}{batching_mode:<15}{workload:<11}{pad['padded_over_real']:>12.2f}"
                    f"{pad['tokens_per_s']:>14,.0f}{pack['tokens_per_s']:>14,.0f}"
                    f"{pack['tokens_per_s'] / pad['tokens_per_s']:>14.2f}x"
                    f"{gib(pad['peak_rss']) + ' / ' + gib(pack['peak_rss']):>19}",
                    flush=True,
                )
    if args.skip_chunks:
        return 0
    print(
        "\n--log-probs-chunk-size (vocabulary 32,768; packed micro-batches of <= 4096 tokens, long-tail "
        "workload)"
    )
    print(f"{'backend':<9}{'chunk':>7}{'tok/s':>10}{'log-prob pass peak GiB':>24}{'training peak GiB':>19}")
    for backend in args.backends.split(","):
        rows = {}
        for chunk in (-1, 256):
            rows[chunk] = row = measure(
                model=wide,
                backend=backend,
                batching="budget",
                workload="long-tail",
                padded=False,
                chunk=chunk,
                budget=4096,
            )
            print(
                f"{backend:<9}{chunk:>7}{row['tokens_per_s']:>10,.0f}{gib(row['log_prob_peak_rss']):>24}"
                f"{gib(row['peak_rss']):>19}",
                flush=True,
            )
        for what, key in (("log-prob pass", "log_prob_peak_rss"), ("training", "peak_rss")):
            saved = rows[-1][key] - rows[256][key]
            print(
                f"{backend:<9}chunks of 256: {what} peak {gib(saved)} GiB lower ({saved / rows[-1][key]:.0%})"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
