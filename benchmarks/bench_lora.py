"""LoRA against full fine-tuning on the FSDP actor (and the Megatron actor: --train-backends
fsdp megatron): memory per rank, the push's size and time, the step time, in one run (the
baseline is full fine-tuning of the same model with the same backend).

    python benchmarks/bench_lora.py [--model-path DIR] [--ranks 2] [--rank 8] [--rollouts 3]
        [--target-modules all-linear] [--train-backends fsdp megatron]

With Megatron the ranks are tensor-parallel ranks (each holds its shard of every layer).

The model (default: a 12-layer, 768-wide Qwen3 built here, 75.6 M parameters) trains on --ranks
gloo ranks, one process each, with the rollout of benchmarks/bench_train.py (64 samples, two
optimizer steps per rollout). Per mode and rank it reports:

- trainable parameters, and the optimizer state + gradient bytes of the rank (AdamW: two
  float32 moments per trainable parameter; the gradients of the trainable parameters);
- parameter bytes of the rank (the frozen base included: LoRA does not shrink it);
- the push: the bytes and seconds of exporting what the engines must receive. Full fine-tuning
  exports every weight; LoRA exports the base weights with the adapters merged (the merge-and-push
  that runs today) and, separately, the adapters alone (what the adapter push sends);
- seconds per rollout (median after one warm-up).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_rank(rank, world_size, init_method, model_path, lora_rank, targets, rollouts, backend):
    import torch
    from bench_train import make_rollout

    from slime.backends import make_train_actor
    from slime.config.lora import LoRAConfig
    from slime.config.train import BatchConfig, MegatronConfig, OptimizerConfig, TrainConfig

    cfg = TrainConfig(
        hf_checkpoint=model_path,
        optimizer=OptimizerConfig(lr=1e-5),
        batch=BatchConfig(global_batch_size=32, micro_batch_size=8),
    )
    if lora_rank:
        cfg = dataclasses.replace(
            cfg, lora=LoRAConfig(rank=lora_rank, alpha=2 * lora_rank, target_modules=targets)
        )
    if backend == "megatron":
        cfg = dataclasses.replace(
            cfg, backend="megatron", megatron=MegatronConfig(tensor_model_parallel_size=world_size)
        )
    actor = make_train_actor(cfg, rank, world_size, init_method)
    actor.init()
    vocab = actor.backend.hf_config.vocab_size
    seconds = []
    for r in range(rollouts + 1):
        start = time.perf_counter()
        actor.train(r, make_rollout(r, vocab))
        seconds.append(time.perf_counter() - start)

    def local_bytes(tensors) -> int:
        return sum(
            t.to_local().numel() * t.element_size()
            if hasattr(t, "to_local")
            else t.numel() * t.element_size()
            for t in tensors
        )

    params = list(actor.backend.model.parameters())
    trainable = [p for p in params if p.requires_grad]
    optimizer = sum(
        local_bytes([v])
        for s in actor.backend.optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    start = time.perf_counter()
    pushed = sum(t.numel() * t.element_size() for bucket in actor.export_weights(1 << 30) for _, t in bucket)
    push_s = time.perf_counter() - start
    adapter_bytes, adapter_s = 0, 0.0
    if lora_rank:
        start = time.perf_counter()
        named, _ = actor.export_adapter()  # what --lora-push adapter sends
        adapter_bytes = sum(t.numel() * t.element_size() for _, t in named)
        adapter_s = time.perf_counter() - start
    actor.close()
    return {
        "trainable": sum(p.numel() for p in trainable),
        "optimizer_and_grad_bytes": optimizer + local_bytes(trainable),
        "param_bytes": local_bytes(params),
        "push_bytes": pushed,
        "push_s": push_s,
        "adapter_bytes": adapter_bytes,
        "adapter_s": adapter_s,
        "s_per_rollout": statistics.median(seconds[1:]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--rank", type=int, default=8, help="the LoRA rank")
    parser.add_argument("--target-modules", default="all-linear")
    parser.add_argument("--rollouts", type=int, default=3)
    parser.add_argument("--train-backends", nargs="+", default=["fsdp"], choices=["fsdp", "megatron"])
    args = parser.parse_args()
    model_path = args.model_path
    if model_path is None:
        from slime.tools.make_tiny_model import main as make_tiny_model

        model_path = os.path.join(tempfile.mkdtemp(prefix="bench-lora-"), "model")
        make_tiny_model(
            [
                "--out",
                model_path,
                "--hidden-size",
                "768",
                "--num-layers",
                "12",
                "--num-heads",
                "12",
                "--num-kv-heads",
                "4",
            ]
        )
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tests.dist_helpers import run_ranks

    targets = tuple(t.strip() for t in args.target_modules.split(","))
    for backend in args.train_backends:
        full = run_ranks(args.ranks, run_rank, model_path, 0, targets, args.rollouts, backend)[0]
        low = run_ranks(args.ranks, run_rank, model_path, args.rank, targets, args.rollouts, backend)[0]
        print(
            f"\n{backend}: model {model_path}, {args.ranks} ranks, LoRA rank {args.rank} on "
            f"{args.target_modules}; per rank 0:"
        )
        table(full, low)
    return 0


def table(full: dict, low: dict) -> None:
    mb = 1e6
    print(f"{'':34}{'full':>14}{'LoRA':>14}{'LoRA / full':>14}")
    rows = [
        ("trainable parameters", full["trainable"], low["trainable"], 1),
        ("optimizer + gradient MB", full["optimizer_and_grad_bytes"], low["optimizer_and_grad_bytes"], mb),
        ("parameter MB", full["param_bytes"], low["param_bytes"], mb),
        ("push MB (full / merged)", full["push_bytes"], low["push_bytes"], mb),
        ("push MB (full / adapters alone)", full["push_bytes"], low["adapter_bytes"], mb),
        ("export s (full / merged)", full["push_s"], low["push_s"], 1),
        ("export s (full / adapters alone)", full["push_s"], low["adapter_s"], 1),
        ("s per rollout", full["s_per_rollout"], low["s_per_rollout"], 1),
    ]
    for label, a, b, unit in rows:
        print(f"{label:34}{a / unit:>14.4g}{b / unit:>14.4g}{b / a if a else float('nan'):>14.4f}")


if __name__ == "__main__":
    sys.exit(main())
