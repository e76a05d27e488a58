"""What `--check-weight-sync` adds to a weight push, per transport, against the push alone.

    python benchmarks/bench_weight_sync.py [--repeats 5] [--large]

One torch engine serves the default tiny Qwen3 (2.9 M parameters, 11.7 MB; with --large also a
hidden-1024, 8-layer one); the checkpoint's own tensors are pushed through each transport with
push_actor_weights, without and with verification (the trainer fingerprints each bucket on a
worker thread after sending it; the engine fingerprints each parameter as it copies it in and
returns them with its answer; the lists are compared). Reported: best push seconds without the
check and with it, the trainer's fingerprint seconds (overlapped with the push), the comparison
seconds, and the overhead relative to the push alone (target: under 5% on the tiny model).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.bridge.bridge import WeightBridge, make_transport
from slime.bridge.push import push_actor_weights
from slime.bridge.topology import build_topology
from slime.engines.torch_engine.launcher import start_torch_engine
from slime.tools.make_tiny_model import main as make_tiny_model
from slime.utils.async_utils import run_sync
from slime.utils.buckets import iter_buckets


class Exporter:
    """A trainer holding exactly the checkpoint the engine loaded (a push source: slime.bridge.push)."""

    pushes_adapter = False

    def __init__(self, model_dir: str):
        self.state = load_file(os.path.join(model_dir, "model.safetensors"))

    def export_weights(self, bucket_bytes: int, every_rank: bool = False):
        return iter_buckets(self.state.items(), bucket_bytes)


def measure(url: str, model: str, transport: str, repeats: int) -> dict[str, float]:
    actor = Exporter(model)
    bridge = WeightBridge(make_transport(build_topology(transport, "cpu", [url]), model), [url])
    best = {"plain": float("inf"), "checked": float("inf"), "trainer": float("inf"), "compare": float("inf")}
    try:
        push_actor_weights(actor, bridge, "warm-up", 512 << 20, verify=True)
        for r in range(repeats):
            start = time.perf_counter()
            push_actor_weights(actor, bridge, f"p{r}", 512 << 20)
            best["plain"] = min(best["plain"], time.perf_counter() - start)
            start = time.perf_counter()
            stats = push_actor_weights(actor, bridge, f"c{r}", 512 << 20, verify=True)
            best["checked"] = min(best["checked"], time.perf_counter() - start)
            assert stats is not None
            best["trainer"] = min(best["trainer"], stats["verify_trainer_seconds"])
            best["compare"] = min(best["compare"], stats["verify_compare_seconds"])
    finally:
        run_sync(bridge.close())
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--large", action="store_true", help="also a hidden-1024, 8-layer model")
    args = parser.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-weight-sync-")
    models = {"tiny (11.7 MB)": os.path.join(tmp, "tiny")}
    make_tiny_model(["--out", models["tiny (11.7 MB)"]])
    if args.large:
        models["large"] = os.path.join(tmp, "large")
        make_tiny_model(
            ["--out", models["large"], "--hidden-size", "1024", "--num-layers", "8", "--num-heads", "8"]
        )
    print(
        f"{'model':<16}{'transport':<13}{'push s':>9}{'push+check s':>14}"
        f"{'trainer fp s':>14}{'compare s':>11}{'overhead':>10}"
    )
    for label, model in models.items():
        engine = start_torch_engine(model, ["--num-threads", "1"], log_path=os.path.join(tmp, "engine.log"))
        try:
            for transport in ("tensor", "distributed", "disk"):
                b = measure(engine.url, model, transport, args.repeats)
                overhead = b["checked"] / b["plain"] - 1
                print(
                    f"{label:<16}{transport:<13}{b['plain']:>9.4f}{b['checked']:>14.4f}{b['trainer']:>14.4f}"
                    f"{b['compare']:>11.4f}{100 * overhead:>9.1f}%"
                )
        finally:
            engine.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
