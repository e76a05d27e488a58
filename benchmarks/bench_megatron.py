"""Megatron train actor against the FSDP train actor on the same rollouts, per layout.

    python benchmarks/bench_megatron.py [--rollouts 3] [--layouts fsdp1,tp1,fsdp2,tp2,pp2,dp2]

Workload: bench_train.py's rollouts (64 samples, prompts 16-48 tokens, responses 32-96, global
batch 32 = two optimizer steps, micro-batches of 8, GRPO, AdamW) on a tiny Qwen3 (hidden 256,
4 layers) built locally; each rank one thread. Layouts: `fsdp1` / `fsdp2` the FSDP actor on 1 / 2
ranks (the baselines), `tp1` Megatron on 1 rank, `tp2` / `pp2` / `dp2` Megatron on 2 ranks as TP 2,
PP 2, DP 2. Reported: median tokens/s of `train()` (log-prob pass + two optimizer steps) over
--rollouts after one warm-up rollout, and the ratio to the FSDP baseline with the same number of
ranks, measured in the same run. On CPU megatron-core runs through slime.backends.megatron.cpu_shim.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_train import GLOBAL_BATCH, MICRO_BATCH, make_rollout
from slime.algo.objective import LossConfig
from slime.config.train import BatchConfig, MegatronConfig, OptimizerConfig, TrainConfig
from slime.tools.make_tiny_model import main as make_tiny_model

LAYOUTS = {  # name: (backend, ranks, TP, PP)
    "fsdp1": ("fsdp", 1, 1, 1),
    "tp1": ("megatron", 1, 1, 1),
    "fsdp2": ("fsdp", 2, 1, 1),
    "tp2": ("megatron", 2, 2, 1),
    "pp2": ("megatron", 2, 1, 2),
    "dp2": ("megatron", 2, 1, 1),
}


def _rank(rank: int, world: int, init: str, out: str, model: str, layout: str, rollouts: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from slime.backends import make_train_actor

    backend, _, tp, pp = LAYOUTS[layout]
    cfg = TrainConfig(
        hf_checkpoint=model,
        backend=backend,
        loss=LossConfig(),
        optimizer=OptimizerConfig(lr=1e-5),
        batch=BatchConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH),
        megatron=MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp),
    )
    actor = make_train_actor(cfg, rank, world, init)
    actor.init()
    vocab = actor.backend.hf_config.vocab_size
    times, tokens = [], []
    for r in range(rollouts + 1):
        batch = make_rollout(r, vocab)
        start = time.perf_counter()
        actor.train(r, batch)
        if r:  # the first rollout warms up
            times.append(time.perf_counter() - start)
            tokens.append(sum(len(t) for t in batch.tokens))
    actor.close()
    if rank == 0:
        torch.save({"tokens_per_s": statistics.median(n / t for n, t in zip(tokens, times))}, out)


def run(model: str, layout: str, rollouts: int, tmp: str) -> float:
    world = LAYOUTS[layout][1]
    init = f"file://{os.path.join(tmp, 'rdzv-' + layout)}"
    out = os.path.join(tmp, layout + ".pt")
    mp.start_processes(
        _rank, args=(world, init, out, model, layout, rollouts), nprocs=world, join=True, start_method="spawn"
    )
    return float(torch.load(out)["tokens_per_s"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rollouts", type=int, default=3)
    p.add_argument("--layouts", default=",".join(LAYOUTS))
    args = p.parse_args()
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        p.error(f"--layouts: unknown {unknown}; choose from {', '.join(LAYOUTS)}")
    with tempfile.TemporaryDirectory() as tmp:
        model = os.path.join(tmp, "tiny")
        make_tiny_model(["--out", model])
        results = {name: run(model, name, args.rollouts, tmp) for name in layouts}
    print(f"train() tokens/s, median of {args.rollouts} rollouts (64 samples, 2 optimizer steps each)")
    print(f"{'layout':<10}{'backend':<10}{'ranks':>6}{'tokens/s':>12}{'vs FSDP':>10}")
    for name, value in results.items():
        backend, world, _, _ = LAYOUTS[name]
        base = results.get(f"fsdp{world}")
        ratio = f"{value / base:.2f}x" if base else "-"
        print(f"{name:<10}{backend:<10}{world:>6}{value:>12,.0f}{ratio:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
