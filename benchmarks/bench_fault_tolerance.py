"""What --use-fault-tolerance costs a step, and what one engine killed in the middle of a run costs.

    python benchmarks/bench_fault_tolerance.py [--num-rollout 20] [--warmup 3] [--out DIR]

The demo workload of bench_loop.py (16 prompts x 16 samples per rollout, one FSDP rank, tensor
push) with two engines, run by train.py four times in one go:

- off: no health checks (the baseline);
- slime's defaults: --use-fault-tolerance (a /health_generate round every 30 s);
- every 1 s: --rollout-health-check-interval 1 (a round per second, each a real one-token
  generation on every engine);
- a kill: every 1 s, and one engine killed with SIGKILL when the first group of rollout
  --kill-at is generated (--debug-phase-hook); its groups are generated again on the other
  engine, it is restarted and given the weights.

Prints the mean seconds per step (after --warmup steps) of the step, the generation and the push
with their ratio to the baseline, and for the kill, the time the steps from it took against the
median step before it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_loop import make_demo, run, summarize  # the workload bench_loop.py times

HOOK = """
import os, signal, psutil

def hook(phase, info):
    if phase != "group_generated" or info["evaluation"] or info["groups"] != 1:
        return
    if info["rollout_id"] != int(os.environ["BENCH_KILL_AT"]) or os.path.exists(os.environ["BENCH_KILLED"]):
        return
    open(os.environ["BENCH_KILLED"], "w").close()
    port = int(info["engine"].rsplit(":", 1)[1])
    for c in psutil.net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port:
            os.kill(c.pid, signal.SIGKILL)
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-rollout", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out of the means")
    parser.add_argument("--kill-at", type=int, default=10, help="the rollout in which an engine is killed")
    parser.add_argument("--out", default=None, help="where models, data and logs go (default: a temp dir)")
    args = parser.parse_args()
    if not args.warmup < args.kill_at < args.num_rollout:
        parser.error("need --warmup < --kill-at < --num-rollout")
    out = args.out or tempfile.mkdtemp(prefix="bench-ft-")
    model, task = make_demo(out)
    with open(os.path.join(out, "bench_ft_hook.py"), "w") as f:
        f.write(HOOK)
    os.environ.update(BENCH_KILL_AT=str(args.kill_at), BENCH_KILLED=os.path.join(out, "killed"))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [out, os.environ.get("PYTHONPATH")]))
    two = ("--rollout-num-gpus", "2")
    every_1s = (*two, "--use-fault-tolerance", "--rollout-health-check-interval", "1")
    configs = {
        "off": two,
        "slime defaults": (*two, "--use-fault-tolerance"),
        "every 1 s": every_1s,
        "every 1 s + a kill": (*every_1s, "--debug-phase-hook", "bench_ft_hook.hook"),
    }
    records = {
        name: run("train.py", out, model, task, args.num_rollout, extra, tag=f"-{k}")
        for k, (name, extra) in enumerate(configs.items())
    }
    steady = {name: summarize(r, args.warmup) for name, r in records.items() if "kill" not in name}
    base = steady["off"]
    print(
        f"demo workload, 2 engines, {args.num_rollout} rollouts per run, means over steps {args.warmup + 1}+"
    )
    print(f"{'s/step':<16}" + "".join(f"{p:>22}" for p in ("step", "generate", "push")))
    for name, r in steady.items():
        cells = "".join(f"{r[p]:>12.3f} ({r[p] / base[p]:>5.2f}x)" for p in ("step", "generate", "push"))
        print(f"{name:<16}{cells}")
    killed = records["every 1 s + a kill"]
    before = statistics.median(r["time/step"] for r in killed[args.warmup : args.kill_at])
    after = [r["time/step"] for r in killed if r.get("rollout_id", -1) >= args.kill_at]
    lost = sum(t - before for t in after)
    print(
        f"a kill at rollout {args.kill_at}: median step before it {before:.2f} s; the {len(after)} steps "
        f"from it took {sum(after):.2f} s, {lost:+.2f} s against that median "
        f"({', '.join(f'{t:.2f}' for t in after)})"
    )
    print("(the engine restarts in the background: the steps meanwhile run on one engine, and its start-up")
    print(" competes for the CPU; every rollout of the run was generated and trained)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
