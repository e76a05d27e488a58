"""Weight-push throughput per transport against a plain in-memory copy of the same tensors.

    python benchmarks/bench_push.py [--hidden-size 1024] [--num-layers 8] [--bucket-mb 128] [--repeats 3]

A Qwen3 checkpoint of the given size is built locally and served by one torch engine; the
same weights (a second seed) are pushed through each transport with the WeightBridge (and
`flattened`: the CUDA-IPC push's flattened-bucket path with CPU buffers), and the
engine's parameters are checked bitwise (sha256) after each push. Baseline, same run: copying
every tensor into preallocated destination tensors in this process (`dst.copy_(src)`).
Reported: GB/s per transport (best of --repeats) and the ratio to the copy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from typing import Any

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.bridge.bridge import WeightBridge, make_transport
from slime.bridge.topology import build_topology
from slime.engines.client import EngineClient
from slime.engines.torch_engine.launcher import start_torch_engine
from slime.tools.make_tiny_model import main as make_tiny_model
from slime.utils.buckets import iter_buckets
from slime.utils.checksum import tensor_checksum


def buckets_of(state: dict[str, torch.Tensor], bucket_bytes: int):
    return iter_buckets(state.items(), bucket_bytes)


def copy_rate(state: dict[str, torch.Tensor], repeats: int) -> float:
    dst = {n: torch.empty_like(t) for n, t in state.items()}
    for n, t in state.items():
        dst[n].copy_(t)  # touch the pages once, as the engine's parameters are
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for n, t in state.items():
            dst[n].copy_(t)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


async def push_rate(url: str, transport: str, model: str, state, bucket_bytes: int, repeats: int) -> float:
    """`flattened`: the CUDA-IPC push's code path (slime.bridge.ipc) with CPU buffers shared by file."""
    from slime.bridge.ipc import share_buckets

    topology = build_topology("ipc" if transport == "flattened" else transport, "cpu", [url])
    bridge = WeightBridge(make_transport(topology, model), [url])
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    best = float("inf")
    try:
        for r in range(repeats + 1):  # the first push sets up (group, shared-memory file)
            buckets = buckets_of(state, bucket_bytes)
            if transport == "flattened":
                ipc: Any = bridge.transport  # an IpcTransport for this transport
                buckets = share_buckets(buckets, ipc, sglang_reductions=False)
            stats = await bridge.push(buckets, f"{transport}-{r}")
            if r:
                best = min(best, stats["seconds"])
        async with EngineClient(url) as c:
            got = (await c.weights_checksum())["checksums"]
        assert got == {n: tensor_checksum(t) for n, t in state.items()}, (
            "engine weights differ after the push"
        )
    finally:
        await bridge.close()
    return nbytes / best / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="bench-push-")
    size = ["--hidden-size", str(args.hidden_size), "--num-layers", str(args.num_layers), "--num-heads", "8"]
    model = os.path.join(tmp, "a")
    make_tiny_model(["--out", model, *size])
    make_tiny_model(["--out", os.path.join(tmp, "b"), "--seed", "1", *size])
    state = load_file(os.path.join(tmp, "b", "model.safetensors"))
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    baseline = copy_rate(state, args.repeats)
    engine = start_torch_engine(
        model, ["--num-threads", str(args.threads)], log_path=os.path.join(tmp, "engine.log")
    )
    rates = {}
    try:
        for transport in ("tensor", "flattened", "distributed", "disk"):
            rates[transport] = asyncio.run(
                push_rate(engine.url, transport, model, state, args.bucket_mb << 20, args.repeats)
            )
    finally:
        engine.stop()
    print(f"weights: {nbytes / 1e6:.0f} MB fp32, buckets of {args.bucket_mb} MB, best of {args.repeats}")
    print(f"{'path':<28}{'GB/s':>8}{'vs copy':>10}")
    print(f"{'in-memory copy (baseline)':<28}{baseline:>8.2f}{1.0:>10.2f}")
    for name, rate in rates.items():
        print(f"{name + ' transport':<28}{rate:>8.2f}{rate / baseline:>10.2f}")
    print(f"tensor / copy = {rates['tensor'] / baseline:.2f} (target >= 0.50)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
