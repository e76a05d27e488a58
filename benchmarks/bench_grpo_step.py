"""A whole GRPO step on one device, phase by phase, against the hardware's limits and plain baselines.

    python benchmarks/bench_grpo_step.py --device cuda [--preset qwen3-0.6b] [--train-backend fsdp|megatron]
        [--prompts 32] [--samples-per-prompt 16] [--prompt-len 64 256] [--max-new-tokens 512]
        [--steps 3] [--bandwidth-gbs GB/S] [--peak-tflops TFLOPS] [--hf-samples 64] [--out DIR] [--profile]
        [--torch-compile]
    python benchmarks/bench_grpo_step.py --device cpu [...]     (the demo model: the smoke run)

The job is train.py as users run it on one device: `--colocate --offload`, the torch engine and the
trainer taking turns on the device, the weights pushed over CUDA IPC (shared memory on CPU) after
every step. Each rollout is --prompts prompts (random text, --prompt-len tokens, seeded) x
--samples-per-prompt samples of up to --max-new-tokens tokens at temperature 1; the train step is
one optimizer step over the whole rollout (packed micro-batches under --max-tokens-per-gpu). On
CUDA the engine and the trainer compute in bfloat16, the engine runs every sample at once, and the
log-probs' float32 softmax runs 1,024 tokens at a time (`--log-probs-chunk-size`).

With --torch-compile the engines decode through torch.compile (SGLang's --enable-torch-compile,
for every batch size) and the FSDP trainer's decoder layers run compiled (--fsdp-torch-compile);
the first step compiles, the second compiles a few of the trainer's graphs again with a dynamic
token count, so both are left out of the medians. The plain PyTorch loop stays eager.

Per phase, the median over the steps after the first (the first warms kernels and CUDA graphs):
- rollout: generated tokens/s and its share of the memory roofline: an ideal engine's time, each
  decode step reading the weights once plus every live sequence's K/V (its prompt and the tokens
  so far), all sequences starting together, at the device's bandwidth (a table of known GPUs,
  --bandwidth-gbs to override); the engines' busy share of the step, and on CUDA their seconds
  capturing decode graphs (again every step: the memory release drops them) and the share of
  forward steps replayed from one (slime's perf/engine_* metrics);
- the log-prob pass and the train step: tokens/s and TFLOPS as the trainer reports them (slime's
  perf/* metrics: 6N FLOPs per trained token plus attention), MFU against the device's dense bf16
  peak (--peak-tflops to override; left out on CPU);
- the push (the transfer, and the whole phase with the engines taking their memory back), its
  bytes; the trainer's offload and reload; the step.
Baselines, in the same run on the same device, after the job: Hugging Face `generate` on the
first --hf-samples prompts of the first rollout, each to the length the engine generated (batches
of 64 on CUDA; its tokens/s does not depend on how many batches run), and a plain PyTorch loop
(the same model class, AdamW, autocast bfloat16 on CUDA, padded micro-batches) doing the trainer's
work on the same rollout: a no-grad log-prob pass, then forward, backward and one optimizer step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import step_profile  # noqa: E402
from benchmarks.bench_engine import bench_hf_generate  # noqa: E402
from slime.utils import flops  # noqa: E402

# Memory bandwidth (GB/s) of known GPUs, matched against torch.cuda.get_device_name() in this order.
BANDWIDTH_GBS = (
    ("H100 PCIe", 2000.0),
    ("H100 NVL", 3900.0),
    ("H100", 3350.0),  # SXM
    ("H200 NVL", 4800.0),
    ("H200", 4800.0),
    ("H800", 3350.0),
    ("H20", 4000.0),
    ("B200", 8000.0),
    ("A100-SXM4-40GB", 1555.0),
    ("A100-PCIE-40GB", 1555.0),
    ("A100", 2039.0),  # 80 GB
    ("L40S", 864.0),
)
DEMO_SHAPE = ["--hidden-size", "128", "--num-layers", "4", "--num-heads", "4", "--num-kv-heads", "2"]


def bandwidth_gbs(device_name: str) -> float | None:
    return next((bw for name, bw in BANDWIDTH_GBS if name in device_name), None)


def make_inputs(args: argparse.Namespace, out: str) -> tuple[str, str]:
    """The model (a preset's shape, or the demo's on CPU) and the prompt file under `out`."""
    model = os.path.join(out, "model")
    shape = ["--preset", args.preset] if args.preset else DEMO_SHAPE
    subprocess.run(
        [sys.executable, "-m", "slime.tools.make_tiny_model", "--out", model, *shape],
        check=True,
        capture_output=True,
        cwd=ROOT,
    )
    rng = random.Random(args.seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789 +-*="
    prompts = os.path.join(out, "prompts.jsonl")
    with open(prompts, "w") as f:
        for _ in range(args.prompts * rollouts(args)):
            text = "".join(rng.choice(alphabet) for _ in range(rng.randint(*args.prompt_len)))
            f.write(json.dumps({"prompt": text, "label": "0"}) + "\n")
    return model, prompts


def run_job(args: argparse.Namespace, out: str, model: str, prompts: str) -> list[dict]:
    """train.py on one device; returns its metrics records (one per rollout)."""
    cuda = args.device == "cuda"
    samples = args.prompts * args.samples_per_prompt
    argv = [
        sys.executable,
        os.path.join(ROOT, "train.py"),
        "--hf-checkpoint",
        model,
        "--prompt-data",
        prompts,
        "--rm-type",
        "exact",
        "--advantage-estimator",
        "grpo",
        "--num-rollout",
        str(rollouts(args)),
        "--rollout-batch-size",
        str(args.prompts),
        "--n-samples-per-prompt",
        str(args.samples_per_prompt),
        "--rollout-max-response-len",
        str(args.max_new_tokens),
        "--rollout-temperature",
        "1.0",
        "--global-batch-size",
        str(samples),
        "--use-dynamic-batch-size",
        "--max-tokens-per-gpu",
        str(args.max_tokens_per_gpu),
        "--lr",
        "1e-6",
        "--seed",
        str(args.seed),
        "--device",
        args.device,
        "--colocate",
        "--offload",
        "--rollout-backend",
        "torch",
        "--update-weight-transport",
        "tensor",
        "--train-backend",
        args.train_backend,
        "--sglang-max-running-requests",
        str(samples),
        "--sglang-max-prefill-tokens",
        "65536",
        # the KV cache no longer than a sample can be (it grows by doubling up to this)
        "--sglang-context-length",
        str(args.prompt_len[1] + args.max_new_tokens + 16),
        "--save-debug-rollout-data",
        os.path.join(out, "rollout_{rollout_id}.pt"),
    ]
    if cuda:  # bfloat16 compute; the log-probs' float32 softmax a chunk of tokens at a time
        argv += ["--sglang-dtype", "bfloat16", "--log-probs-chunk-size", "1024"]
        argv += (
            ["--bf16", "--transformer-impl", "local"]
            if args.train_backend == "megatron"
            else ["--fsdp-param-dtype", "bfloat16"]
        )
    if args.peak_tflops:
        argv += ["--peak-tflops", str(args.peak_tflops)]
    if args.torch_compile:  # every batch size the rollout decodes; the FSDP trainer's layers
        argv += ["--sglang-enable-torch-compile", "--sglang-torch-compile-max-bs", str(samples)]
        if args.train_backend == "fsdp":
            argv += ["--fsdp-torch-compile"]
    log_dir = os.path.join(out, "logs")
    env = {**os.environ, "SLIME_LOG_DIR": log_dir, "TOKENIZERS_PARALLELISM": "false"}
    if args.profile:  # the extra last rollout
        flags, settings = step_profile.job_flags(out, args.steps, args.max_new_tokens)
        argv += flags
        env.update(settings)
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"train.py failed with exit code {proc.returncode}")
    print(f"train.py: {rollouts(args)} rollouts in {time.perf_counter() - start:.1f} s (logs in {log_dir})")
    with open(os.path.join(log_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "time/step" in r][: args.steps]


def rollouts(args: argparse.Namespace) -> int:
    """The job's rollouts: --steps, and the profiled one after them with --profile."""
    return args.steps + (1 if args.profile else 0)


def load_rollout(out: str, rollout_id: int) -> list[dict]:
    return torch.load(os.path.join(out, f"rollout_{rollout_id}.pt"), weights_only=True)["samples"]


def lengths(samples: list[dict]) -> tuple[list[int], list[int]]:
    """(prompt lengths, response lengths) of a rollout's samples."""
    responses = [int(s["response_length"]) for s in samples]
    return [len(s["tokens"]) - r for s, r in zip(samples, responses)], responses


def roofline_seconds(config: dict, prompts: list[int], responses: list[int], bandwidth: float) -> float:
    """An ideal engine's decode time (see the module docstring): bytes read / bandwidth."""
    text = flops.text_config(config)
    get = text.get if isinstance(text, dict) else lambda k, d=None: getattr(text, k, d)
    heads = get("num_attention_heads")
    head_dim = get("head_dim") or get("hidden_size") // heads
    dtype_bytes = 2 if config["_engine_dtype"] != "float32" else 4
    kv_per_token = (
        get("num_hidden_layers") * (get("num_key_value_heads") or heads) * head_dim * 2 * dtype_bytes
    )
    weight_bytes = config["_num_parameters"] * dtype_bytes
    total = 0.0
    for t in range(1, max(responses) + 1):  # decode step t: the sequences still generating
        live = [p + t for p, r in zip(prompts, responses) if r >= t]
        total += weight_bytes + kv_per_token * sum(live)
    return total / (bandwidth * 1e9)


def plain_train(model_path: str, samples: list[dict], device: str, max_tokens: int) -> tuple[float, float]:
    """The trainer's work on `samples` as a bare loop: (log-prob pass seconds, train seconds)."""
    from transformers import AutoModelForCausalLM

    dev = torch.device(device)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=dev.type == "cuda")
    autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda")
    rewards = torch.tensor([float(s.get("reward") or 0.0) for s in samples])
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6) if len(samples) > 1 else rewards
    batches, batch = [], []  # padded micro-batches of at most max_tokens padded tokens, in order
    for i, s in enumerate(samples):
        width = max([len(samples[j]["tokens"]) for j in batch] + [len(s["tokens"])])
        if batch and width * (len(batch) + 1) > max_tokens:
            batches.append(batch)
            batch = []
        batch.append(i)
    batches.append(batch)
    num_response = sum(int(s["response_length"]) for s in samples)

    def forward(rows: list[int]) -> torch.Tensor:
        """Each response token's log-prob, summed over the rows with their advantage as weight."""
        width = max(len(samples[i]["tokens"]) for i in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        weight = torch.zeros((len(rows), width - 1))
        for r, i in enumerate(rows):
            tokens, n = samples[i]["tokens"], int(samples[i]["response_length"])
            ids[r, : len(tokens)] = torch.tensor(tokens)
            mask[r, : len(tokens)] = 1
            weight[r, len(tokens) - 1 - n : len(tokens) - 1] = advantages[i]
        ids, mask, weight = ids.to(dev), mask.to(dev), weight.to(dev)
        with autocast:
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
        return (logp * weight).sum()

    def timed(fn) -> float:
        _sync(dev)
        start = time.perf_counter()
        fn()
        _sync(dev)
        return time.perf_counter() - start

    def log_prob_pass() -> None:
        with torch.no_grad():
            for rows in batches:
                forward(rows)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        for rows in batches:
            (-forward(rows) / num_response).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    timed(train_step)  # warm-up: kernels, the optimizer's states
    return timed(log_prob_pass), timed(train_step)


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def median(records: list[dict], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.median(values) if values else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument(
        "--preset",
        default=None,
        choices=["qwen3-0.6b", "qwen2.5-0.5b", "qwen3-1.7b"],
        help="the model's shape (default: qwen3-0.6b on CUDA, the demo model on CPU)",
    )
    ap.add_argument("--train-backend", default="fsdp", choices=["fsdp", "megatron"])
    ap.add_argument("--prompts", type=int, default=None, help="prompts per rollout (default: 32; CPU 2)")
    ap.add_argument("--samples-per-prompt", type=int, default=None, help="default: 16; CPU 2")
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[64, 256], metavar=("MIN", "MAX"))
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: 512; CPU 8")
    ap.add_argument(
        "--steps",
        type=int,
        default=3,
        help="rollouts; the first is left out of the medians (the first two with --torch-compile)",
    )
    ap.add_argument("--max-tokens-per-gpu", type=int, default=None, help="default: 8192; CPU 4096")
    ap.add_argument("--bandwidth-gbs", type=float, default=None, help="default: the GPU's, from a table")
    ap.add_argument("--peak-tflops", type=float, default=None, help="default: the GPU's dense bf16 peak")
    ap.add_argument("--hf-samples", type=int, default=64, help="samples HF generate runs")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=None, help="where the model, data and logs go (default: a temp dir)")
    ap.add_argument(
        "--profile",
        action="store_true",
        help="one more rollout, profiled (trainer and engine; out of the medians): tables in <out>/profile",
    )
    ap.add_argument(
        "--torch-compile",
        action="store_true",
        help="the engines' decode step and the FSDP trainer's layers through torch.compile",
    )
    args = ap.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no CUDA device; use --device cpu")
    if cuda and args.preset is None:
        args.preset = "qwen3-0.6b"
    defaults = {
        "prompts": (32, 2),
        "samples_per_prompt": (16, 2),
        "max_new_tokens": (512, 8),
        "max_tokens_per_gpu": (8192, 4096),
    }
    for name, (gpu, cpu) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, gpu if cuda else cpu)
    if args.steps <= warm_up_steps(args):
        ap.error(
            f"--steps must be at least {warm_up_steps(args) + 1} (the first "
            f"{'two warm' if args.torch_compile else 'warms'} up)"
        )
    out = args.out or tempfile.mkdtemp(prefix="bench-grpo-step-")
    model, prompts = make_inputs(args, out)
    records = run_job(args, out, model, prompts)
    met = report(args, out, model, records)
    if args.profile:
        step_profile.print_tables(out)
    return 0 if met else 1  # 1: a target missed (scripts/gpu-check.sh)


METRICS = (
    "time/generate",
    "time/log_probs",
    "time/train",
    "time/push",
    "time/step",
    "push/bytes",
    "perf/log_probs_tflops",
    "perf/actor_train_tok_per_s",
    "perf/actor_train_tflops",
    "perf/actor_train_mfu",
    "perf/update_weights_time",
    "perf/sleep_time",
    "perf/wake_up_time",
    "perf/rollout_offload_time",
    "perf/rollout_onload_time",
    "perf/engine_cuda_graph_capture_time",
    "perf/engine_cuda_graph_replay_share",
    "time/engine_busy_share",
)


def warm_up_steps(args: argparse.Namespace) -> int:
    """The steps left out of the medians: the first (kernels, CUDA graphs); with --torch-compile
    the second too, where the trainer's graphs compile again with a dynamic token count."""
    return 2 if args.torch_compile else 1


def report(args: argparse.Namespace, out: str, model: str, records: list[dict]) -> bool:
    """Print the phase table, the baselines and (Qwen3-0.6B on CUDA) the targets; False if one
    was missed."""
    cuda = args.device == "cuda"
    config = model_facts(model, "bfloat16" if cuda else "float32")
    device_name = torch.cuda.get_device_name() if cuda else "CPU"
    bandwidth = args.bandwidth_gbs or (bandwidth_gbs(device_name) if cuda else None)
    peak = args.peak_tflops or (flops.peak_tflops(device_name) if cuda else None)
    steady = records[warm_up_steps(args) :]
    rollouts = [load_rollout(out, r["rollout_id"]) for r in steady]
    rollout_tps, roof_tps = [], []
    for r, samples in zip(steady, rollouts):
        prompts, responses = lengths(samples)
        rollout_tps.append(sum(responses) / r["time/generate"])
        if bandwidth:
            roof_tps.append(sum(responses) / roofline_seconds(config, prompts, responses, bandwidth))
    m = {key: median(steady, key) for key in METRICS}
    m["rollout_tps"] = statistics.median(rollout_tps)
    m["roofline_tps"] = statistics.median(roof_tps) if roof_tps else None
    first = rollouts[0]  # the baselines' workload
    m.update(baselines(args, model, config, first, peak))
    print(
        f"\n{args.preset or 'demo model'} ({config['_num_parameters']:,} parameters), "
        f"{args.train_backend}, {device_name}; {args.prompts} prompts x {args.samples_per_prompt} samples, "
        f"prompts {args.prompt_len[0]}-{args.prompt_len[1]} tokens, up to {args.max_new_tokens} new; "
        f"medians of steps {warm_up_steps(args) + 1}-{args.steps}; "
        f"bandwidth {_f(bandwidth, '{:,.0f}')} GB/s, peak {_f(peak, '{:,.0f}')} TFLOPS"
    )
    rows = phase_rows(m, first)
    width = max(len(r[0]) for r in rows)
    print(f"{'phase'.ljust(width)} | {'seconds':>11} | rate")
    print(f"{'-' * width}-|-{'-' * 11}-|-----")
    for name, seconds, rate in rows:
        print(f"{name.ljust(width)} | {seconds:>11} | {rate}")
    train_tps = m["perf/actor_train_tok_per_s"]
    print(
        f"\nratio engine / HF generate: {m['rollout_tps'] / m['hf_tps']:.2f}x; trainer / plain PyTorch "
        f"(train tokens/s): {_f(train_tps / m['plain_tps'] if train_tps else None)}x"
    )
    return check_targets(m) if cuda and args.preset == "qwen3-0.6b" else True


def baselines(
    args: argparse.Namespace, model: str, config: dict, samples: list[dict], peak: float | None
) -> dict:
    """HF `generate` and the plain PyTorch loop on `samples` (a rollout of the job's)."""
    cuda = args.device == "cuda"
    hf = [
        (s["tokens"][: len(s["tokens"]) - int(s["response_length"])], int(s["response_length"]))
        for s in samples[: args.hf_samples]
    ]
    hf_tps = bench_hf_generate(
        model,
        hf,
        batch_size=64 if cuda else 32,
        device=args.device,
        dtype=torch.bfloat16 if cuda else torch.float32,
    )
    log_probs_s, train_s = plain_train(model, samples, args.device, args.max_tokens_per_gpu)
    seq_lens = [len(s["tokens"]) for s in samples]
    model_flops = flops.from_config(config)
    tflops = model_flops.train_flops(seq_lens) / train_s / 1e12 if model_flops else None
    return {
        "hf_tps": hf_tps,
        "plain_log_probs_s": log_probs_s,
        "plain_train_s": train_s,
        "plain_tps": sum(seq_lens) / train_s,
        "plain_tflops": tflops,
        "plain_mfu": tflops / peak if tflops and peak else None,
    }


def phase_rows(m: dict, first: list[dict]) -> list[tuple[str, str, str]]:
    """The table's rows: (phase, seconds, rate) from the medians and baselines in `m`."""
    roof, mfu, plain_mfu = m["roofline_tps"], m["perf/actor_train_mfu"], m["plain_mfu"]
    share = f", {100 * m['rollout_tps'] / roof:.1f}% of the roofline {roof:,.0f}" if roof else ""
    train = (
        f"{_f(m['perf/actor_train_tok_per_s'], '{:,.0f}')} tok/s, "
        f"{_f(m['perf/actor_train_tflops'], '{:.3g}')} TFLOPS" + (f", MFU {100 * mfu:.1f}%" if mfu else "")
    )
    plain = f"{m['plain_tps']:,.0f} tok/s, {_f(m['plain_tflops'], '{:.3g}')} TFLOPS" + (
        f", MFU {100 * plain_mfu:.1f}%" if plain_mfu else ""
    )
    seconds = {key: _f(m[key], "{:.3f}") for key in METRICS if key.endswith("_time")}
    generated, trained = sum(lengths(first)[1]), sum(len(s["tokens"]) for s in first)
    return [
        ("rollout", _f(m["time/generate"]), f"{m['rollout_tps']:,.0f} tok/s{share}"),
        ("  HF generate, same prompts", "", f"{m['hf_tps']:,.0f} tok/s"),
        ("  engines busy (share of the step)", "", _f(m["time/engine_busy_share"], "{:.0%}")),
        (
            "  engines' CUDA graphs: captures",
            seconds["perf/engine_cuda_graph_capture_time"],
            f"forward steps replayed: {_f(m['perf/engine_cuda_graph_replay_share'], '{:.0%}')}",
        ),
        ("log-prob pass", _f(m["time/log_probs"]), f"{_f(m['perf/log_probs_tflops'], '{:.3g}')} TFLOPS"),
        ("train step", _f(m["time/train"]), train),
        (
            "  plain PyTorch: log-probs + train",
            f"{m['plain_log_probs_s']:.2f} + {m['plain_train_s']:.2f}",
            plain,
        ),
        ("push: the transfer", seconds["perf/update_weights_time"], f"{m['push/bytes'] or 0:,.0f} bytes"),
        ("push: the whole phase", _f(m["time/push"]), "trainer offload, engines' memory back, transfer"),
        ("trainer offload (sleep)", seconds["perf/sleep_time"], ""),
        ("trainer reload (wake_up)", seconds["perf/wake_up_time"], ""),
        ("engines' memory: release", seconds["perf/rollout_offload_time"], ""),
        ("engines' memory: resume", seconds["perf/rollout_onload_time"], ""),
        (
            "whole step",
            _f(m["time/step"]),
            f"{len(first)} samples, {generated:,} generated, {trained:,} trained tokens",
        ),
    ]


def check_targets(m: dict) -> bool:
    """The issue's targets for Qwen3-0.6B on one GPU, one line each; False if one was missed."""
    roof, mfu, push = m["roofline_tps"], m["perf/actor_train_mfu"], m["perf/update_weights_time"]
    targets = [
        ("rollout share of its roofline", 100 * m["rollout_tps"] / roof if roof else None, ">=", 40, "%"),
        ("train MFU", 100 * mfu if mfu else None, ">=", 25, "%"),
        ("push", 1000 * push if push else None, "<=", 100, " ms"),
        ("whole step", m["time/step"], "<=", 20, " s"),
    ]
    met = True
    for name, value, op, limit, unit in targets:
        ok = value is not None and (value >= limit if op == ">=" else value <= limit)
        met = met and ok
        print(f"target {name} {op} {limit}{unit}: {_f(value, '{:.1f}')}{unit} {'PASS' if ok else 'FAIL'}")
    return met


def model_facts(model: str, engine_dtype: str) -> dict:
    """The checkpoint's config.json, with its parameter count and the engine's dtype added."""
    from safetensors import safe_open

    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    with safe_open(os.path.join(model, "model.safetensors"), "pt") as st:
        config["_num_parameters"] = sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    config["_engine_dtype"] = engine_dtype
    return config


def _f(value: float | None, fmt: str = "{:.2f}") -> str:
    return "n/a" if value is None else fmt.format(value)


if __name__ == "__main__":
    raise SystemExit(main())
