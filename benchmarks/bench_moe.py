"""Tiny mixture-of-experts model against a dense model of equal active parameters: engine and train tokens/s.

    python benchmarks/bench_moe.py [--threads 2] [--rollouts 3]

Models (built in a temp dir with slime.tools.make_tiny_model, default vocabulary): both have
hidden size 128, 4 layers, 4 query / 2 key-value heads. The MoE model is a Qwen3-MoE with 8
experts of width 128 per layer, top-2 routing; the dense baseline, measured in the same run, is
a Qwen3 with MLP width 256 (top-k x expert width), so each token goes through the same number of
parameters: the MoE model's active count exceeds the dense model's only by its routers (hidden x
experts per layer), which the benchmark checks.

Engine: the torch engine server (as benchmarks/bench_engine.py runs it), 32 requests with prompt
lengths 8-48 and max_new_tokens 32-96 drawn with a fixed seed, all submitted at once (client
concurrency 32), each generating exactly its max_new_tokens (ignore_eos) at temperature 1; one
warm-up, then the median generated tokens/s over --rollouts runs.

Train: the FSDP train actor on one rank with benchmarks/bench_train.py's workload per rollout
(64 samples, prompt 16-48 tokens, response 32-96, fixed seed; global batch 32, micro-batches of
8, GRPO policy loss, AdamW): a no-grad log-prob pass, then forward/backward/step. Reported: the
median of (prompt + response tokens of the rollout) / seconds of `actor.train` over --rollouts
after one warm-up rollout. Ratios are MoE / dense.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_HERE))
sys.path.insert(0, _HERE)

from bench_engine import make_workload, run_engine  # noqa: E402
from bench_train import GLOBAL_BATCH, MICRO_BATCH, make_rollout  # noqa: E402

from slime.config.train import BatchConfig, OptimizerConfig, TrainConfig  # noqa: E402
from slime.engines.torch_engine.launcher import start_torch_engine  # noqa: E402
from slime.tools.make_tiny_model import main as make_tiny_model  # noqa: E402
from slime.utils import hf_experts  # noqa: E402
from slime.utils.rollout_batch import RolloutBatch  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS = 128, 4, 4, 2
NUM_EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 128
NUM_REQUESTS, CONCURRENCY = 32, 32


@dataclass
class ParamCounts:
    total: int
    active: int
    router: int  # router weights (active for every token); 0 for a dense model


def build_models(tmp: str) -> dict[str, str]:
    common = ["--hidden-size", str(HIDDEN), "--num-layers", str(LAYERS)]
    common += ["--num-heads", str(HEADS), "--num-kv-heads", str(KV_HEADS)]
    paths = {"MoE": os.path.join(tmp, "moe"), "dense": os.path.join(tmp, "dense")}
    moe = ["--num-experts", str(NUM_EXPERTS), "--num-experts-per-tok", str(TOP_K)]
    moe += ["--moe-intermediate-size", str(EXPERT_WIDTH)]
    make_tiny_model(["--out", paths["MoE"], "--arch", "qwen3_moe", *common, *moe])
    dense = ["--intermediate-size", str(TOP_K * EXPERT_WIDTH)]  # top-k x expert width
    make_tiny_model(["--out", paths["dense"], "--arch", "qwen3", *common, *dense])
    return paths


def count_params(model_path: str) -> tuple[ParamCounts, Any]:
    """Total parameters; active = total minus the experts a token is not routed to."""
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    total = sum(p.numel() for p in model.parameters())
    inactive = router = 0
    layers = model.model.layers
    for li, gate in hf_experts.find_routers(layers).items():
        experts = layers[li].mlp.experts
        per_expert = sum(p.numel() for p in experts.parameters()) // gate.num_experts
        inactive += (gate.num_experts - gate.top_k) * per_expert
        router += sum(p.numel() for p in gate.parameters())
    return ParamCounts(total, total - inactive, router), model.config


def bench_engine(model_path: str, reqs: list, threads: int, runs: int, log_path: str) -> float:
    engine = start_torch_engine(model_path, ["--num-threads", str(threads)], log_path=log_path)
    try:
        asyncio.run(run_engine(engine.url, reqs, CONCURRENCY))  # warm-up
        rates = [asyncio.run(run_engine(engine.url, reqs, CONCURRENCY))[0] for _ in range(runs)]
    finally:
        engine.stop()
    return statistics.median(rates)


def bench_train(model_path: str, vocab: int, rollouts: int, rendezvous: str) -> tuple[float, str]:
    from slime.backends.fsdp.actor import FSDPTrainActor

    cfg = TrainConfig(
        hf_checkpoint=model_path,
        optimizer=OptimizerConfig(lr=1e-5),
        batch=BatchConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH),
    )
    actor = FSDPTrainActor(cfg, 0, 1, f"file://{rendezvous}")  # a one-rank gloo process group
    actor.init()
    experts_impl = str(getattr(actor.backend.model.config, "_experts_implementation", None))
    try:

        def run(rollout_id: int, batch: RolloutBatch) -> float:
            start = time.perf_counter()
            actor.train(rollout_id, batch)
            return sum(len(t) for t in batch.tokens) / (time.perf_counter() - start)

        run(0, make_rollout(100, vocab))  # warm-up
        rates = [run(r + 1, make_rollout(r, vocab)) for r in range(rollouts)]
    finally:
        actor.close()
    return statistics.median(rates), experts_impl


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=3, help="measured train rollouts and engine runs")
    parser.add_argument("--seed", type=int, default=1234, help="engine workload seed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="bench_moe_")
    paths = build_models(tmp)

    counts: dict[str, ParamCounts] = {}
    engine_tps: dict[str, float] = {}
    train_tps: dict[str, float] = {}
    impl: dict[str, str] = {}
    for name, path in paths.items():
        counts[name], config = count_params(path)
        reqs = make_workload(NUM_REQUESTS, args.seed, config.vocab_size, max_new=(32, 96), prompt=(8, 48))
        log = os.path.join(tmp, f"engine-{name}.log")
        engine_tps[name] = bench_engine(path, reqs, args.threads, args.rollouts, log)
        rendezvous = os.path.join(tmp, f"rendezvous-{name}")
        train_tps[name], impl[name] = bench_train(path, config.vocab_size, args.rollouts, rendezvous)

    moe, dense = counts["MoE"], counts["dense"]
    # The routers are the only parameters a MoE token uses that the dense model has no match for.
    assert moe.active - moe.router == dense.active == dense.total, (moe, dense)

    print(
        f"\nmodels: hidden {HIDDEN}, {LAYERS} layers, {HEADS}/{KV_HEADS} heads; MoE {NUM_EXPERTS} experts "
        f"x width {EXPERT_WIDTH}, top-{TOP_K} (experts implementation in training: {impl['MoE']}); "
        f"dense MLP width {TOP_K * EXPERT_WIDTH}; threads {args.threads}"
    )
    print(
        f"engine: {NUM_REQUESTS} requests, prompt 8-48, max_new_tokens 32-96 (seed {args.seed}), "
        f"concurrency {CONCURRENCY}, median of {args.rollouts}; train: FSDP actor, 1 rank, median of "
        f"{args.rollouts} rollouts"
    )
    header = (
        f"{'model':<6} | {'total params':>12} | {'active params':>13} | {'engine tok/s':>12} | "
        f"{'train tok/s':>11}"
    )
    print(header)
    print("-" * len(header))
    for name in paths:
        c = counts[name]
        print(
            f"{name:<6} | {c.total:>12,} | {c.active:>13,} | {engine_tps[name]:>12,.0f} | "
            f"{train_tps[name]:>11,.0f}"
        )
    print(
        f"active params: MoE - dense = {moe.active - dense.active:,} (the routers, {LAYERS} x "
        f"{NUM_EXPERTS} x {HIDDEN}); MoE total / active = {moe.total / moe.active:.2f}x"
    )
    print(f"ratio MoE / dense, engine tokens/s: {engine_tps['MoE'] / engine_tps['dense']:.2f}x")
    print(f"ratio MoE / dense, train tokens/s:  {train_tps['MoE'] / train_tps['dense']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
