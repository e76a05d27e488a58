"""What the OpenAI agent adapter adds to a turn, against a direct /generate measured in the same run.

    python benchmarks/bench_agent_adapter.py [--sessions 16] [--turns 6] [--max-new-tokens 8]

A torch engine serves a tiny model; the adapter runs in this process on its own thread. Each
session is an agent that appends to its history: `--turns` chat completions through the adapter
(POST /v1/chat/completions with aiohttp, one request at a time), each followed at once by a
direct POST /generate of the same prompt ids with the same sampling parameters and seed, so both
paths generate the same tokens on the same engine. Every turn generates exactly
--max-new-tokens tokens (ignore_eos). Reported: per-turn wall time of both paths (p50, p90,
mean), the adapter's added time (the difference of the p50s), the adapter's own work per turn
(rendering, parsing, recording: its `latency_s`), and the share of turns rendered in full and of
samples that forked or realigned (0 for an agent that appends).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.agent.adapters import OpenAIAdapter
from slime.agent.adapters.generate import sampling_params
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.engines.torch_engine.launcher import start_torch_engine
from slime.tools.make_tiny_model import main as make_tiny_model
from slime.utils.sample import Sample


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run(
    args: argparse.Namespace, adapter: OpenAIAdapter, adapter_url: str, engine_url: str, tag: str = "run"
) -> dict:
    turns: list = []
    adapter.debug_callback = lambda sid, msgs, tools, reply, turn: turns.append(turn)
    via, direct, samples = [], [], []
    async with aiohttp.ClientSession() as http:
        for k in range(args.sessions):
            sid = f"bench-{tag}-{k}"
            defaults = {
                "temperature": 1.0,
                "max_new_tokens": args.max_new_tokens,
                "ignore_eos": True,
                "sampling_seed": 1000 + k,
            }
            adapter.open_session(sid, sampling_defaults=defaults)
            messages = [
                {"role": "system", "content": "you are terse"},
                {"role": "user", "content": f"task {k}"},
            ]
            for t in range(args.turns):
                body = {"model": "m", "messages": messages}
                start = time.perf_counter()
                async with http.post(
                    f"{adapter_url}/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {sid}"},
                ) as r:
                    reply = await r.json()
                    assert r.status == 200, reply
                via.append(time.perf_counter() - start)
                while adapter.inflight.get(sid):  # the answer is sent before the turn is recorded
                    await asyncio.sleep(0.001)
                params = sampling_params(adapter.store[sid], body, adapter.max_token_keys, adapter.stop_keys)
                start = time.perf_counter()
                async with http.post(
                    f"{engine_url}/generate",
                    json={
                        "input_ids": turns[-1].prompt_ids,
                        "sampling_params": params,
                        "return_logprob": True,
                    },
                ) as r:
                    out = await r.json()
                direct.append(time.perf_counter() - start)
                assert [p[1] for p in out["meta_info"]["output_token_logprobs"]] == turns[-1].output_ids
                messages += [
                    {"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""},
                    {"role": "user", "content": f"and then {t}"},
                ]
            samples += await adapter.finish_session(sid, base_sample=Sample(index=k))
    return {"via": via, "direct": direct, "own": list(adapter.latency_s), "samples": samples}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--model-path", default=None)
    args = p.parse_args()
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model_path or os.path.join(tmp, "tiny")
        if args.model_path is None:
            make_tiny_model(["--out", model])
        engine = start_torch_engine(model, ["--num-threads", "1"])
        adapter = OpenAIAdapter(tokenizer=AutoTokenizer.from_pretrained(model), sglang_url=engine.url)
        handle = run_app_in_thread(adapter.app)
        try:
            # Warm-up (the engine's first requests, the adapter's first template render).
            warm = argparse.Namespace(sessions=1, turns=2, max_new_tokens=2)
            asyncio.run(run(warm, adapter, handle.url, engine.url, tag="warm"))
            adapter.latency_s.clear()
            result = asyncio.run(run(args, adapter, handle.url, engine.url))
        finally:
            handle.stop()
            engine.stop()
    via = [1000 * x for x in result["via"]]
    direct = [1000 * x for x in result["direct"]]
    own = [1000 * x for x in result["own"]]
    n = len(via)
    print(
        f"{args.sessions} sessions x {args.turns} turns, {args.max_new_tokens} new tokens a turn, one "
        "request at a time\n"
    )
    print("| path | p50 ms | p90 ms | mean ms | p50 ratio |")
    print("|---|---|---|---|---|")
    for name, xs in (("direct /generate (baseline)", direct), ("through the adapter", via)):
        print(
            f"| {name} | {pct(xs, 0.5):.2f} | {pct(xs, 0.9):.2f} | {statistics.fmean(xs):.2f} | "
            f"{pct(xs, 0.5) / pct(direct, 0.5):.2f}x |"
        )
    print(
        f"\nadded per turn: p50 {pct(via, 0.5) - pct(direct, 0.5):.2f} ms (the adapter's own work: p50 "
        f"{pct(own, 0.5):.2f} ms, p90 {pct(own, 0.9):.2f} ms over {len(own)} turns)"
    )
    samples = result["samples"]
    full = sum(s.metadata["rendered_in_full"] for s in samples)
    drifted = sum(1 for s in samples if s.metadata["forked_turns"] or s.metadata["realigned_turns"])
    print(
        f"turns rendered in full: {full} of {n - args.sessions}; samples that forked or realigned: "
        f"{drifted} of {len(samples)} ({len(samples)} samples for {args.sessions} sessions)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
