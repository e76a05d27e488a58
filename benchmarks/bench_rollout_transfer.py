"""What one rollout costs the driver: bytes that pass through it and its memory, by value vs by reference.

    python benchmarks/bench_rollout_transfer.py [--samples 64 1024] [--response-len 512] [--ranks 2]

A producer actor makes a rollout of synthetic samples (prompt 64 tokens, `--response-len` response
tokens with log-probs and loss masks, as the rollout manager holds them), and `--ranks` train-rank
actors take it, two ways:
- by value (the loop before issue 17): the driver `ray.get`s the train batch, the metrics and every
  sample as a dict, then sends the batch again to every train rank;
- by reference (now): the producer splits the rollout per data-parallel rank with the code the
  rollout manager runs (`package_rollout`), puts each part in the object store and returns the
  summary; the driver hands each rank its part's reference, and the rank fetches it itself.

Each configuration runs in a fresh driver process (its own local Ray) so its peak RSS is its own.
Prints bytes through the driver per step (what it received plus what it sent, pickled) and the
driver's peak RSS growth over the step, and the ratio by value / by reference.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_samples(num_samples: int, response_len: int, prompt_len: int = 64) -> list:
    import random

    from slime.utils.sample import Sample, Status

    rng = random.Random(0)
    samples = []
    for i in range(num_samples):
        tokens = [rng.randrange(1, 150_000) for _ in range(prompt_len + response_len)]
        samples.append(
            Sample(
                index=i,
                group_index=i // 8,
                prompt="x" * 200,
                tokens=tokens,
                response="y" * 1_000,
                response_length=response_len,
                label="42",
                reward=float(i % 2),
                loss_mask=[1] * response_len,
                rollout_log_probs=[-rng.random() for _ in range(response_len)],
                status=Status.COMPLETED,
                weight_versions=["0"],
            )
        )
    return samples


def measure(mode: str, num_samples: int, response_len: int, ranks: int) -> dict:
    """One step in this (fresh) driver process."""
    import ray
    from ray import cloudpickle

    from slime.config.train import BatchConfig

    ray.init(num_cpus=ranks + 1, include_dashboard=False, log_to_driver=False)
    batch_cfg = BatchConfig(micro_batch_size=1)

    @ray.remote
    class Producer:
        def __init__(self):
            self.samples = make_samples(num_samples, response_len)

        def by_value(self):
            from slime.rollout.summary import rollout_metrics
            from slime.utils.sample import samples_to_batch

            batch = samples_to_batch(self.samples)
            return (
                batch,
                rollout_metrics(self.samples, None),
                [s.to_dict() for s in self.samples],
                {"offset": 1},
            )

        def by_reference(self):
            from slime.rollout.summary import package_rollout, rollout_metrics

            metrics = rollout_metrics(self.samples, None)
            split = (batch_cfg, ranks)
            return package_rollout(0, self.samples, None, split, ray.put, metrics, data_state={"offset": 1})

    @ray.remote
    class Rank:
        def take(self, data) -> int:
            batch = getattr(data, "batch", data)
            return len(batch)

    producer, train = Producer.remote(), [Rank.remote() for _ in range(ranks)]
    ray.get([r.take.remote([]) for r in train])  # actors up before the measurement
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if mode == "value":
        result = ray.get(producer.by_value.remote())
        received = len(cloudpickle.dumps(result))
        sent = sum(len(cloudpickle.dumps(result[0])) for _ in train)
        seen = ray.get([r.take.remote(result[0]) for r in train])
    else:
        rollout = ray.get(producer.by_reference.remote())
        received = len(cloudpickle.dumps(rollout))
        sent = sum(len(cloudpickle.dumps(rollout.parts[d])) for d in range(ranks))
        seen = ray.get([r.take.remote(rollout.parts[d]) for d, r in enumerate(train)])
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ray.shutdown()
    return {"bytes": received + sent, "rss_growth_mb": (peak - rss_before) / 1024, "samples_seen": sum(seen)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, nargs="+", default=[64, 1024])
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)  # MODE SAMPLES: one run, in a child
    args = p.parse_args()
    if args.measure:
        mode, n = args.measure
        print(json.dumps(measure(mode, int(n), args.response_len, args.ranks)))
        return
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    print(f"{'samples':>8} {'mode':>10} {'driver bytes/step':>18} {'driver RSS growth MB':>21}")
    for n in args.samples:
        rows = {}
        for mode in ("value", "reference"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--measure",
                    mode,
                    str(n),
                    "--response-len",
                    str(args.response_len),
                    "--ranks",
                    str(args.ranks),
                ],
                env=env,
                capture_output=True,
                text=True,
                check=True,
            )
            rows[mode] = json.loads(out.stdout.strip().splitlines()[-1])
            assert rows[mode]["samples_seen"] == (n * args.ranks if mode == "value" else n)
            print(f"{n:>8} {mode:>10} {rows[mode]['bytes']:>18,} {rows[mode]['rss_growth_mb']:>21.1f}")
        ratio = rows["value"]["bytes"] / rows["reference"]["bytes"]
        print(f"{n:>8} {'ratio':>10} {ratio:>17,.0f}x (bytes by value / by reference)")


if __name__ == "__main__":
    main()
