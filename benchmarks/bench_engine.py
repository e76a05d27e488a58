"""Torch engine throughput and memory against Hugging Face `generate`, measured in the same run.

    python benchmarks/bench_engine.py [--model-path DIR] [--threads 2] [--leak-requests 1000]
        [--compare-src DIR]
    python benchmarks/bench_engine.py --device cuda [--requests 256] [--hf-requests 64]
    python benchmarks/bench_engine.py --null-model [--batch 256] [--new-tokens 128] [--compare-src DIR]

CPU (default). Workload: 64 requests, prompt lengths 8-64 and max_new_tokens 16-128 drawn with a
fixed seed, all submitted at once; every request generates exactly its max_new_tokens
(ignore_eos), sampled at temperature 1; also with the decode step compiled (`--enable-torch-compile`,
after a warm-up that compiles). Baseline, measured in the same run: `model.generate` on
the same requests in left-padded batches of 32 (each batch runs to its longest max_new_tokens;
only the requested tokens are counted). Also: torch-engine tokens/s at client concurrency 1, 8,
32, 64, and the engine process RSS before and after --leak-requests requests. `--compare-src DIR`
also runs the engine from another source tree (a `git worktree` of an earlier commit) on the same
requests, for a before/after figure in one run.

CUDA (`--device cuda`): a Qwen3 shape of hidden 1024 x 16 layers (16 heads, 8 KV heads, ~190M
parameters with the tiny model's character vocabulary) in bfloat16 unless --model-path; 256
requests in flight (prompt 32-256 tokens, 64-512 new tokens, ignore_eos, temperature 1). The
engine runs as configured by default (CUDA graphs, overlapped decode steps, attention over each
sequence's live keys), then with the decode step compiled (`--enable-torch-compile`, every batch
size), in rounds of 4 decode steps per host round trip, with attention over
padded keys (the kernel before live keys), with --disable-overlap-schedule and with
--disable-cuda-graph; HF `generate` runs on the first
--hf-requests requests in left-padded batches of 64 (its tokens/s per batch does not depend on
how many batches run). GPU busy: nvidia-smi's utilization sampled every 100 ms while the engine
decodes.

Host overhead (`--null-model`, any machine): the engine's own work per decode step (scheduling,
building the step's inputs, sampling's bookkeeping, booking tokens, stop checks) with the model's
forward replaced by a no-op that returns zero logits, so what is left is what the host spends per
step, in microseconds. --batch sequences (prompts 32-95 tokens) decode --new-tokens tokens each,
ignore_eos, temperature 1 (--temperature), all in one batch; the engine runs in process, stepped
by this script; `--stop S` gives every request the stop string S (never produced), so the
stop-string check is part of each step.
Configurations: one step per host round trip, booked before the next launch; overlapped (the
default on CUDA); rounds of 4 and 8 steps (`--num-continuous-decode-steps`), overlapped. With
--compare-src DIR the same is measured on another source tree (a `git worktree` of an earlier
commit: the before), in the same run. On CPU the no-op's zero logits still go through sampling on
the CPU (a small vocabulary keeps that cheap), so the figure is an upper bound of the host's part.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

import psutil
import torch

# The tree whose `slime` is measured: this one, or --compare-src's in a --null-model worker.
sys.path.insert(
    0, os.environ.get("BENCH_SLIME_SRC") or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)

from slime.engines.client import ClientConfig, EngineClient
from slime.engines.torch_engine.launcher import start_torch_engine
from slime.tools.make_tiny_model import main as make_tiny_model


def make_workload(n: int, seed: int, vocab: int, max_new=(16, 128), prompt=(8, 64)):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        length = rng.randint(*prompt)
        reqs.append(([rng.randrange(4, vocab) for _ in range(length)], rng.randint(*max_new)))
    return reqs


def bench_hf_generate(
    model_path: str, reqs, batch_size: int = 32, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    model.eval()
    pad = model.config.pad_token_id or 0
    useful = sum(m for _, m in reqs)
    _sync(device)
    start = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, (p, _) in enumerate(batch):
            ids[j, width - len(p) :] = torch.tensor(p)
            mask[j, width - len(p) :] = 1
        with torch.no_grad():
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=max(m for _, m in batch),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                eos_token_id=None,
                pad_token_id=pad,
                min_new_tokens=max(m for _, m in batch),
            )
    _sync(device)
    elapsed = time.perf_counter() - start
    del model
    if device != "cpu":
        torch.cuda.empty_cache()
    return useful / elapsed


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


async def run_engine(url: str, reqs, concurrency: int) -> tuple[float, int]:
    async with EngineClient(url, ClientConfig(max_concurrency=concurrency)) as c:
        start = time.perf_counter()
        results = await asyncio.gather(
            *[
                c.generate(
                    p,
                    sampling_params={"max_new_tokens": m, "temperature": 1.0, "ignore_eos": True},
                    return_logprob=True,
                )
                for p, m in reqs
            ]
        )
        elapsed = time.perf_counter() - start
    tokens = sum(r["meta_info"]["completion_tokens"] for r in results)
    assert tokens == sum(m for _, m in reqs), "engine generated a different number of tokens than requested"
    return tokens / elapsed, tokens


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="default: build the workload's model in a temp dir")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--leak-requests", type=int, default=1000, help="CPU: requests of the RSS check (0: skip)"
    )
    ap.add_argument("--compare-src", default=None, help="CPU: also run the engine from this source tree")
    ap.add_argument("--requests", type=int, default=None, help="default: 64 (cpu), 256 (cuda)")
    ap.add_argument("--hf-requests", type=int, default=64, help="CUDA: requests HF generate runs")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--null-model", action="store_true", help="the host's time per decode step (see above)")
    ap.add_argument("--batch", type=int, default=256, help="--null-model: sequences decoding at once")
    ap.add_argument("--new-tokens", type=int, default=128, help="--null-model: tokens each sequence decodes")
    ap.add_argument("--repeats", type=int, default=3, help="--null-model: runs per configuration (median)")
    ap.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="--null-model: 0 leaves sampling's noise out (on CPU most of what is left is that)",
    )
    ap.add_argument(
        "--stop",
        default=None,
        help="--null-model: a stop string every request carries (never produced: the check's cost)",
    )
    ap.add_argument("--null-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.null_worker:
        return null_worker(args)
    tmp = tempfile.mkdtemp(prefix="bench_engine_")
    if args.null_model:
        return bench_null(args, tmp)
    if args.device == "cuda":
        return bench_cuda(args, tmp)
    return bench_cpu(args, tmp)


def bench_cpu(args: argparse.Namespace, tmp: str) -> int:
    model_path = args.model_path or os.path.join(tmp, "tiny")
    if not args.model_path:
        make_tiny_model(["--out", model_path])
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    reqs = make_workload(args.requests or 64, args.seed, vocab)
    rows = []
    flags = ["--num-threads", str(args.threads)]
    engine = start_torch_engine(model_path, flags, log_path=os.path.join(tmp, "engine.log"))
    rss_before = rss_after = leak_time = 0.0
    try:
        asyncio.run(run_engine(engine.url, reqs[:8], 8))  # warm-up
        engine_tps, _ = asyncio.run(run_engine(engine.url, reqs, 64))
        sweep = {c: asyncio.run(run_engine(engine.url, reqs, c))[0] for c in (1, 8, 32, 64)}
        proc = psutil.Process(engine.proc.pid)
        rss_before = proc.memory_info().rss
        if args.leak_requests:
            leak_reqs = make_workload(args.leak_requests, args.seed + 1, vocab, max_new=(4, 32))
            start = time.perf_counter()
            asyncio.run(run_engine(engine.url, leak_reqs, 64))
            leak_time = time.perf_counter() - start
        rss_after = proc.memory_info().rss
    finally:
        engine.stop()
    compiled = start_torch_engine(
        model_path,
        [*flags, "--enable-torch-compile", "--torch-compile-max-bs", "64"],
        log_path=os.path.join(tmp, "compiled.log"),
    )
    try:
        asyncio.run(run_engine(compiled.url, reqs[:8], 8))  # warm-up: its steps compile
        compiled_tps, _ = asyncio.run(run_engine(compiled.url, reqs, 64))
    finally:
        compiled.stop()
    before_tps = None
    if args.compare_src:
        # PYTHONSAFEPATH: `python -m` must not put our working directory ahead of the other tree.
        env = {"PYTHONPATH": os.path.abspath(args.compare_src), "PYTHONSAFEPATH": "1"}
        other = start_torch_engine(model_path, flags, log_path=os.path.join(tmp, "before.log"), env=env)
        try:
            asyncio.run(run_engine(other.url, reqs[:8], 8))
            before_tps, _ = asyncio.run(run_engine(other.url, reqs, 64))
        finally:
            other.stop()
    hf_tps = bench_hf_generate(model_path, reqs)

    ratio = engine_tps / hf_tps
    growth_mb = (rss_after - rss_before) / 2**20
    rows.append(("HF generate (padded batches of 32)", f"{hf_tps:,.0f}"))
    rows.append(("torch engine (64 at once)", f"{engine_tps:,.0f}"))
    rows.append(("torch engine, --enable-torch-compile (64 at once)", f"{compiled_tps:,.0f}"))
    if before_tps is not None:
        rows.append((f"torch engine from {args.compare_src} (64 at once)", f"{before_tps:,.0f}"))
    for c, tps in sweep.items():
        rows.append((f"torch engine, concurrency {c}", f"{tps:,.0f}"))
    print(
        f"\nworkload: {len(reqs)} requests, prompt 8-64, max_new_tokens 16-128 (seed {args.seed}), "
        f"{sum(m for _, m in reqs)} tokens, {args.threads} threads"
    )
    _table(rows)
    print(
        f"\nratio torch engine / HF generate: {ratio:.2f}x (target >= 1.5x: "
        f"{'PASS' if ratio >= 1.5 else 'FAIL'})"
    )
    print(f"ratio --enable-torch-compile / eager decode steps: {compiled_tps / engine_tps:.2f}x")
    if before_tps is not None:
        print(
            f"ratio this tree / {args.compare_src}: {engine_tps / before_tps:.2f}x (target >= 1.0x within "
            "noise)"
        )
    if args.leak_requests:
        print(
            f"engine RSS: {rss_before / 2**20:.1f} MB before, {rss_after / 2**20:.1f} MB after "
            f"{args.leak_requests} requests ({leak_time:.1f} s); growth {growth_mb:+.1f} MB "
            f"(target < 50 MB: {'PASS' if growth_mb < 50 else 'FAIL'})"
        )
    return 0


COMPILED = "torch.compile (--enable-torch-compile)"


def cuda_configs(n: int) -> tuple[tuple[str, list[str]], ...]:
    """The engine configurations the CUDA run measures, the default first; `n` requests."""
    return (
        ("CUDA graphs, overlap", []),
        # every batch compiled (SGLang's default limit is 32); the engine compiles at its start
        (COMPILED, ["--enable-torch-compile", "--torch-compile-max-bs", str(n)]),
        ("rounds of 4 (--num-continuous-decode-steps 4)", ["--num-continuous-decode-steps", "4"]),
        ("padded keys (--attention-backend torch_native)", ["--attention-backend", "torch_native"]),
        ("CUDA graphs (--disable-overlap-schedule)", ["--disable-overlap-schedule"]),
        ("eager (--disable-cuda-graph)", ["--disable-cuda-graph"]),
    )


def bench_cuda(args: argparse.Namespace, tmp: str) -> int:
    model_path = args.model_path or os.path.join(tmp, "qwen3-190m")
    if not args.model_path:
        make_tiny_model(
            [
                "--out",
                model_path,
                "--hidden-size",
                "1024",
                "--num-layers",
                "16",
                "--num-heads",
                "16",
                "--num-kv-heads",
                "8",
                "--max-position-embeddings",
                "4096",
            ]
        )
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model_path).vocab_size
    reqs = make_workload(args.requests or 256, args.seed, vocab, max_new=(64, 512), prompt=(32, 256))
    n = len(reqs)
    flags = [
        "--device",
        "cuda",
        "--dtype",
        "bfloat16",
        "--max-running-requests",
        str(n),
        "--max-prefill-tokens",
        "16384",
        "--num-threads",
        str(args.threads),
    ]
    results = {}
    for name, extra in cuda_configs(n):
        log = os.path.join(tmp, f"engine-{len(results)}.log")
        engine = start_torch_engine(model_path, flags + extra, log_path=log)
        try:
            asyncio.run(run_engine(engine.url, reqs[:16], 16))  # warm-up: kernels, first graphs
            with GpuBusy() as busy:
                tps, _ = asyncio.run(run_engine(engine.url, reqs, n))
            results[name] = (tps, busy.mean(), _server_stats(engine.url))
        finally:
            engine.stop()
    hf = reqs[: args.hf_requests]
    hf_tps = bench_hf_generate(model_path, hf, batch_size=64, device="cuda", dtype=torch.bfloat16)

    rows = [(f"HF generate (padded batches of 64, {len(hf)} requests)", f"{hf_tps:,.0f}", "")]
    for name, (tps, busy_pct, _) in results.items():
        rows.append((f"torch engine, {name}", f"{tps:,.0f}", _pct(busy_pct)))
    print(
        f"\nworkload: {n} requests in flight, prompt 32-256, max_new_tokens 64-512 (seed {args.seed}), "
        f"{sum(m for _, m in reqs)} tokens, bfloat16, {torch.cuda.get_device_name()}"
    )
    _table(rows, ("tokens/s", "GPU busy"))
    for name, (_, _, stats) in results.items():
        print(f"{name}: engine stats {stats}")
    tps, busy_pct, _ = results["CUDA graphs, overlap"]
    compiled_tps, _, compiled_stats = results[COMPILED]
    failed = compiled_stats.get("torch_compile_failed")
    print(f"\nratio --enable-torch-compile / the default: {compiled_tps / tps:.2f}x")
    if failed:
        print(f"WARNING: --enable-torch-compile fell back to eager decoding: {failed}")
    ratio = tps / hf_tps
    print(
        f"\nratio torch engine / HF generate: {ratio:.2f}x (target >= 10x: "
        f"{'PASS' if ratio >= 10 else 'FAIL'})"
    )
    verdict = "n/a" if busy_pct is None else ("PASS" if busy_pct >= 60 else "FAIL")
    print(f"GPU busy while the engine decodes: {_pct(busy_pct)} (target >= 60%: {verdict})")
    return 1 if ratio < 10 or verdict == "FAIL" else 0  # scripts/gpu-check.sh reports a missed target


NULL_CONFIGS = (
    ("one step per round trip", {"overlap_schedule": False}),
    ("overlapped (the CUDA default)", {"overlap_schedule": True}),
    ("4 steps per round, overlapped", {"overlap_schedule": True, "num_continuous_decode_steps": 4}),
    ("8 steps per round, overlapped", {"overlap_schedule": True, "num_continuous_decode_steps": 8}),
)


def bench_null(args: argparse.Namespace, tmp: str) -> int:
    """The host's time per decode step with a no-op model, this tree (and --compare-src's)."""
    import json

    model_path = os.path.join(tmp, "tiny")
    make_tiny_model(["--out", model_path, "--num-layers", "1", "--hidden-size", "64"])
    trees = [("this tree", None)] + (
        [(args.compare_src, os.path.abspath(args.compare_src))] if args.compare_src else []
    )
    measured: dict[str, dict[str, float]] = {}  # tree -> configuration -> us per step
    for label, src in trees:
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        if src is not None:
            env["BENCH_SLIME_SRC"] = src
        argv = [
            sys.executable,
            os.path.abspath(__file__),
            "--null-worker",
            model_path,
            "--threads",
            str(args.threads),
            "--batch",
            str(args.batch),
            "--new-tokens",
            str(args.new_tokens),
            "--repeats",
            str(args.repeats),
            "--temperature",
            str(args.temperature),
            *(["--stop", args.stop] if args.stop else []),
        ]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True).stdout
        measured[label] = json.loads(out.strip().splitlines()[-1])
    print(
        f"\nno-op model: {args.batch} sequences x {args.new_tokens} tokens, prompts 32-95, ignore_eos, "
        f"temperature {args.temperature:g}{f', stop {args.stop!r}' if args.stop else ''}, "
        f"{args.threads} thread(s), median of {args.repeats}"
    )
    rows = [
        (f"{label}: {name}", f"{us:,.0f}") for label, runs in measured.items() for name, us in runs.items()
    ]
    _table(rows, ("us per decode step",))
    best = min(measured["this tree"].values())
    print(
        f"\nhost time per decode step at batch {args.batch}: {best:,.0f} us, best configuration "
        f"(target <= 1000 us: {'PASS' if best <= 1000 else 'FAIL'})"
    )
    if args.compare_src:
        theirs = min(measured[args.compare_src].values())
        print(f"ratio {args.compare_src} / this tree (best of each): {theirs / best:.2f}x")
    return 0


def null_worker(args: argparse.Namespace) -> int:
    """Measure NULL_CONFIGS with whatever `slime` is on the path (this tree or --compare-src's)."""
    import dataclasses
    import json
    import statistics

    from slime.engines.protocol import parse_generate
    from slime.engines.torch_engine.config import EngineConfig

    known = {f.name for f in dataclasses.fields(EngineConfig)}
    result = {}
    for name, overrides in NULL_CONFIGS:
        if not set(overrides) <= known:
            continue  # a setting this tree does not have
        config = EngineConfig(
            model_path=args.null_worker,
            max_running_requests=args.batch,
            max_prefill_tokens=1 << 30,
            num_threads=args.threads,
            **overrides,
        )
        result[name] = statistics.median(_null_run(config, args, parse_generate) for _ in range(args.repeats))
    print(json.dumps(result))
    return 0


def _null_run(config, args: argparse.Namespace, parse_generate) -> float:
    """Microseconds per decode step of one batch through an engine whose forward is a no-op."""
    from slime.engines.torch_engine.engine import TorchEngine

    engine = TorchEngine(config)
    runner = engine.runner
    logits = torch.zeros((args.batch, engine.vocab_size))
    runner._forward = lambda ids, *rest: logits[: ids.shape[0]]
    prompts = [[4 + (i * 7 + j) % 90 for j in range(32 + i % 64)] for i in range(args.batch)]
    body = {
        "input_ids": prompts,
        "return_logprob": True,
        "sampling_params": {
            "max_new_tokens": args.new_tokens,
            "temperature": args.temperature,
            "ignore_eos": True,
            **({"stop": [args.stop]} if args.stop else {}),
        },
    }
    finished = []
    seqs = [engine.make_sequence(req, finished.append) for req in parse_generate(body)[0]]
    added = engine.add(seqs)
    engine._run_commands()
    added.result()
    engine._step()  # the prefill: the first token of each
    runner.cache.ensure(args.batch, 96 + args.new_tokens)  # its growth is not a per-step cost
    start = time.perf_counter()
    while engine.scheduler.has_work():
        engine._step()
    engine._book_in_flight()
    elapsed = time.perf_counter() - start
    assert len(finished) == args.batch and all(len(s.output_ids) == args.new_tokens for s in finished)
    return elapsed / (args.new_tokens - 1) * 1e6


class GpuBusy:
    """nvidia-smi's GPU utilization (percent of time a kernel ran), sampled every 100 ms."""

    def __enter__(self) -> GpuBusy:
        self.proc = None
        if shutil.which("nvidia-smi"):
            cmd = [
                "nvidia-smi",
                "--query-gpu=utilization.gpu",
                "--format=csv,noheader,nounits",
                "-lms",
                "100",
                "-i",
                os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0],
            ]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.samples: list[float] = []
        if self.proc is not None:
            self.proc.terminate()
            out, _ = self.proc.communicate(timeout=10)
            self.samples = [float(x) for x in out.split() if x.strip().replace(".", "", 1).isdigit()]

    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def _server_stats(url: str) -> dict:
    import json
    import urllib.request

    with urllib.request.urlopen(f"{url}/get_server_info", timeout=10) as r:
        state = json.load(r)["internal_states"][0]
    keys = (
        "num_steps",
        "busy_seconds",
        "decode_attention",
        "decode_shapes",
        "cuda_graphs",
        "cuda_graph_replays",
        "cuda_graph_capture_seconds",
        "cuda_graph_failed",
        "torch_compile_calls",
        "torch_compile_failed",
    )
    return {k: state[k] for k in keys if k in state}


def _pct(value: float | None) -> str:
    return "n/a (no nvidia-smi)" if value is None else f"{value:.0f}%"


def _table(rows, headers=("tokens/s",)) -> None:
    width = max(len(r[0]) for r in rows)
    print(" | ".join(["configuration".ljust(width), *headers]))
    print("-|-".join(["-" * width, *("-" * len(h) for h in headers)]))
    for name, *values in rows:
        print(" | ".join([name.ljust(width), *(v.rjust(len(h)) for v, h in zip(values, headers))]))


if __name__ == "__main__":
    raise SystemExit(main())
