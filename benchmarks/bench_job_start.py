"""How long a small job takes to start and to finish: this checkout against a baseline git ref.

    python benchmarks/bench_job_start.py [--baseline 508c919] [--repeats 3] [--ranks 2]

Both trees run the same train.py job (a tiny local model, 2 rollouts, --ranks FSDP ranks, one
torch engine, --rm-type exact), alternately, attached to one Ray cluster this script starts with
`ray start` (as the end-to-end tests do): so neither pays for starting Ray, and both see the same
machine load. The baseline is checked out with `git worktree` into a temporary directory and put
first on PYTHONPATH for the driver and its actors.

Prints, per tree, the median over the repeats of: seconds from launch to the job's banner (every
process started and connected), and from launch to exit; then the ratio baseline / this checkout.
The default baseline is the last commit before the engines, the rollout manager and the train
ranks started together (issue 17).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run_once(tree: str, model: str, prompts: str, ranks: int, address: str, work: str) -> tuple[float, float]:
    env = {
        **os.environ,
        "RAY_ADDRESS": address,
        "PYTHONPATH": tree,
        "OMP_NUM_THREADS": "1",
        "RAY_AUTH_MODE": "disabled",
        "SLIME_LOG_DIR": os.path.join(work, "logs"),
    }
    argv = [
        sys.executable,
        "-u",
        os.path.join(tree, "train.py"),
        "--hf-checkpoint",
        model,
        "--prompt-data",
        prompts,
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--num-rollout",
        "2",
        "--rollout-max-response-len",
        "3",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "4",
        "--rm-type",
        "exact",
        "--actor-num-gpus-per-node",
        str(ranks),
    ]
    start = time.monotonic()
    banner = None
    proc = subprocess.Popen(
        argv, env=env, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if banner is None and "slime job" in line:
            banner = time.monotonic() - start
    if proc.wait() != 0 or banner is None:
        raise RuntimeError(f"the job in {tree} failed (exit {proc.returncode})")
    return banner, time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", default="508c919", help="git ref to compare against")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()

    from slime.tools.make_tiny_model import main as make_model
    from tests.ray_cluster import RayCluster

    with tempfile.TemporaryDirectory() as tmp:
        model, prompts = os.path.join(tmp, "model"), os.path.join(tmp, "prompts.jsonl")
        assert make_model(["--out", model]) == 0
        with open(prompts, "w") as f:
            f.writelines(json.dumps({"prompt": f"{a}+{a}=", "label": str(2 * a)}) + "\n" for a in range(10))
        old = os.path.join(tmp, "baseline")
        subprocess.run(
            ["git", "-C", ROOT, "worktree", "add", "--detach", old, args.baseline],
            check=True,
            capture_output=True,
        )
        cluster = RayCluster(head_cpus=8)
        try:
            times: dict[str, list[tuple[float, float]]] = {"baseline": [], "this checkout": []}
            for _ in range(args.repeats):
                for name, tree in (("baseline", old), ("this checkout", ROOT)):
                    work = tempfile.mkdtemp(dir=tmp)
                    times[name].append(run_once(tree, model, prompts, args.ranks, cluster.address, work))
        finally:
            cluster.stop()
            subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", old], check=False)
    medians = {name: [statistics.median(t[i] for t in runs) for i in (0, 1)] for name, runs in times.items()}
    print(
        f"job: {args.ranks} FSDP ranks + 1 torch engine, 2 rollouts; median of {args.repeats}; "
        f"baseline = {args.baseline}"
    )
    print(f"{'tree':<16}{'to banner (s)':>16}{'to exit (s)':>14}")
    for name, (banner, total) in medians.items():
        print(f"{name:<16}{banner:>16.1f}{total:>14.1f}")
    (b0, t0), (b1, t1) = medians["baseline"], medians["this checkout"]
    print(f"{'ratio':<16}{b0 / b1:>15.2f}x{t0 / t1:>13.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
