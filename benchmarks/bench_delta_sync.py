"""Delta weight sync against the full disk push: bytes written per push and its times, after real
RL steps, on the demo model and a ~0.5B-parameter shape.

    python benchmarks/bench_delta_sync.py [--shapes demo,0.5b] [--pushes 3] [--lrs 5e-4,1e-6] [--threads 2]

Each shape starts from a fresh model (make_tiny_model), stored in bfloat16 as the engines would
serve it. An FSDP actor (one rank, this process) takes GRPO steps on random rollouts at each
learning rate of --lrs (the demo's 5e-4, scripts/run-tiny-cpu.sh; and 1e-6, slime's model scripts'
usual --lr); after each step its weights, cast to
bfloat16, are pushed three ways with no engine attached (the trainer's side of a push, then one
host's apply):

- full: the disk transport's whole checkpoint (what every push writes without deltas);
- xor / overwrite: --update-weight-mode delta's published version (zstd-compressed, checksummed
  with xxh3-128), then slime.utils.weight_delta.pull_weights applying it to a host checkpoint.

Prints per shape and encoding: bytes written per push / the full bfloat16 checkpoint (mean over
the pushes), publish seconds and apply seconds per push, against the full push in the same run.
Target: xor + zstd writes at most 0.35 of the full checkpoint's bytes at the demo's learning rate.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {  # make_tiny_model arguments
    "demo": ["--hidden-size", "128", "--num-layers", "4", "--num-heads", "4", "--num-kv-heads", "2"],
    "0.5b": [
        "--hidden-size",
        "896",
        "--intermediate-size",
        "4864",
        "--num-layers",
        "24",
        "--num-heads",
        "14",
        "--num-kv-heads",
        "2",
        "--vocab",
        "151936",
    ],  # Qwen2.5-0.5B's shape
}


def make_model(out: str, shape: str) -> tuple[str, str]:
    """(the float32 model the trainer loads, the same weights in bfloat16: the engines' checkpoint)."""
    from safetensors.torch import load_file, save_file

    from slime.tools.make_tiny_model import main as make_tiny_model

    fp32, bf16 = os.path.join(out, "fp32"), os.path.join(out, "bf16")
    make_tiny_model(["--out", fp32, *SHAPES[shape]])
    shutil.copytree(fp32, bf16)
    for name in os.listdir(bf16):
        if name.endswith(".safetensors"):
            path = os.path.join(bf16, name)
            save_file({k: v.to(torch.bfloat16) for k, v in load_file(path).items()}, path, {"format": "pt"})
    return fp32, bf16


def rollout(seed: int, vocab: int):
    from slime.utils.rollout_batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    tokens, resp, rewards = [], [], []
    for _ in range(8):
        prompt, response = 16, 16
        tokens.append(torch.randint(4, vocab, (prompt + response,), generator=g).tolist())
        resp.append(response)
        rewards.append(float(torch.rand((), generator=g) > 0.5))
    return RolloutBatch(tokens, resp, rewards, [i // 4 for i in range(8)])


def exported(actor) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.detach().to(torch.bfloat16).clone()) for b in actor.export_weights(1 << 62) for n, t in b]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="demo,0.5b")
    ap.add_argument("--pushes", type=int, default=3, help="RL steps, each followed by one push of each kind")
    ap.add_argument("--lrs", default="5e-4,1e-6", help="learning rates, each a run of its own")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from slime.algo.objective import LossConfig
    from slime.backends.fsdp.actor import FSDPTrainActor
    from slime.bridge.delta import DeltaDiskTransport
    from slime.bridge.disk import DiskTransport
    from slime.config.train import BatchConfig, OptimizerConfig, TrainConfig
    from slime.utils import weight_delta as wd

    rows = []
    for shape in args.shapes.split(","):
        tmp = tempfile.mkdtemp(prefix="bench-delta-")
        fp32, bf16 = make_model(os.path.join(tmp, "model"), shape)
        full_bytes = sum(
            os.path.getsize(os.path.join(bf16, f)) for f in os.listdir(bf16) if f.endswith(".safetensors")
        )
        for lr in map(float, args.lrs.split(",")):
            run = os.path.join(tmp, f"lr{lr:g}")
            cfg = TrainConfig(
                hf_checkpoint=fp32,
                loss=LossConfig(),
                optimizer=OptimizerConfig(lr=lr),
                batch=BatchConfig(global_batch_size=8, micro_batch_size=8),
            )
            actor = FSDPTrainActor(cfg, 0, 1, f"file://{run}-rendezvous")
            actor.init()
            vocab = actor.backend.hf_config.vocab_size
            delta = {
                e: DeltaDiskTransport(bf16, os.path.join(run, e), os.path.join(run, e + "-host"), e)
                for e in wd.ENCODINGS
            }
            full = DiskTransport(bf16, root=os.path.join(run, "full"))
            times: dict[str, dict[str, list[float]]] = {
                k: {"bytes": [], "publish": [], "apply": []} for k in ("full", *delta)
            }
            for t in delta.values():
                asyncio.run(t.setup([]))
                wd.pull_weights(t.local_dir, t.disk_dir, 0, bf16)
            for step in range(args.pushes):
                actor.train(step, rollout(step, vocab))
                weights = exported(actor)
                start = time.perf_counter()
                asyncio.run(full.send([], weights, str(step)))
                path = full.pending
                asyncio.run(full.finish([], str(step)))
                times["full"]["publish"].append(time.perf_counter() - start)
                assert path is not None
                times["full"]["bytes"].append(
                    sum(
                        os.path.getsize(os.path.join(path, f))
                        for f in os.listdir(path)
                        if f.endswith(".safetensors")
                    )
                )
                times["full"]["apply"].append(0.0)  # the engine loads it as it is
                for encoding, t in delta.items():
                    start = time.perf_counter()
                    asyncio.run(t.send([], weights, str(step)))
                    asyncio.run(t.finish([], str(step)))
                    times[encoding]["publish"].append(time.perf_counter() - start)
                    times[encoding]["bytes"].append(t.stats["bytes"])
                    start = time.perf_counter()
                    wd.pull_weights(t.local_dir, t.disk_dir, t.version, bf16)
                    times[encoding]["apply"].append(time.perf_counter() - start)
            actor.close()
            params = sum(t.numel() for _, t in weights) / 1e6
            for kind, m in times.items():
                rows.append(
                    (
                        shape,
                        lr,
                        params,
                        kind,
                        statistics.fmean(m["bytes"]) / full_bytes,
                        statistics.fmean(m["publish"]),
                        statistics.fmean(m["apply"]),
                    )
                )
            shutil.rmtree(run, ignore_errors=True)
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"{args.pushes} RL steps per run (GRPO, random rollouts), bfloat16 weights, one push of each kind "
        f"after every step; threads {args.threads}"
    )
    print(
        f"{'shape':<6} {'lr':>7} {'params M':>9} {'push':<10} {'bytes / full':>12} {'publish s':>10} "
        f"{'apply s':>8}"
    )
    for shape, lr, params, kind, ratio, publish, apply_s in rows:
        print(
            f"{shape:<6} {lr:>7g} {params:>9.1f} {kind:<10} {ratio:>12.3f} {publish:>10.3f} {apply_s:>8.3f}"
        )
    for shape, lr, _, kind, ratio, _, _ in rows:
        if kind == "xor":
            verdict = "PASS" if ratio <= 0.35 else "FAIL"
            print(f"{shape} lr {lr:g}: xor+zstd / full bytes = {ratio:.3f} (target <= 0.35: {verdict})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
