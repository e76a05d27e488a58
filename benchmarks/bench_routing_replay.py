"""What routing replay (R3, --use-rollout-routing-replay) does to the trainer-vs-engine log-prob gap
of a mixture-of-experts model when the engine and the trainer route tokens differently.

    python benchmarks/bench_routing_replay.py [--arch qwen3_moe ...|all] [--threads 2]
        [--requests 32] [--new-tokens 48]

Model: a tiny model of each `--arch` (a mixture-of-experts family of `make_tiny_model`; default
Qwen3-MoE; `all`: every one) built here: hidden 128, 4 layers, 8 experts, top-2, random weights,
fixed seed. The sigmoid-routed families (GLM-4.5+, DeepSeek-V3, GLM-4.7-Flash) route with their
expert bias and groups, DeepSeek-V3's and GLM-4.7-Flash's first layer is dense; the hybrids
(Qwen3-Next, Qwen3.5-MoE) alternate gated delta-net and full attention. The engine is slime's
torch engine over HTTP, started as a job starts it, with --enable-return-routed-experts; each
request samples --new-tokens tokens at temperature 1 and returns its log-probs and the experts
it routed every token to. The trainer is the FSDP actor on one rank in float32, computing the
log-probs of the same tokens once with the router's own choice and once replaying the engine's
(R3).

Two engine settings, each with its own rollout:
- float32: the same arithmetic as the trainer up to kernel order (the baseline: routing agrees);
- bfloat16: the engine's weights and activations in bfloat16, as on GPUs, so near-tied router
  logits fall on the other side and a token goes to another expert.

Reported per family and setting: the share of (token, MoE layer) routings where the trainer's own choice
differs from the engine's, and |trainer - engine| over the response tokens' log-probs (mean,
99th percentile, max) without and with R3; the ratio is without / with.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.engines.client import ClientConfig, EngineClient
from slime.engines.torch_engine.launcher import start_torch_engine
from slime.tools.make_tiny_model import main as make_tiny_model
from slime.tools.tiny_families import MOE_FAMILIES
from slime.utils.rollout_batch import RolloutBatch
from slime.utils.sample import int32_meta_array

LAYERS, EXPERTS, TOP_K = 4, 8, 2


async def sample(url: str, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    async with EngineClient(url, ClientConfig(max_concurrency=len(prompts))) as client:
        params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
        return list(
            await asyncio.gather(
                *[
                    client.generate(
                        p, sampling_params=params, return_logprob=True, return_routed_experts=True
                    )
                    for p in prompts
                ]
            )
        )


def rollout(model: str, dtype: str, prompts: list[list[int]], new_tokens: int, threads: int, tmp: str):
    """The engine's samples as a RolloutBatch with its log-probs and routed experts."""
    log = os.path.join(tmp, f"engine-{dtype}.log")
    args = ["--num-threads", str(threads), "--dtype", dtype, "--enable-return-routed-experts"]
    engine = start_torch_engine(model, args, log_path=log)
    try:
        answers = asyncio.run(sample(engine.url, prompts, new_tokens))
    finally:
        engine.stop()
    tokens, lengths, log_probs, routed = [], [], [], []
    for prompt, answer in zip(prompts, answers):
        out = answer["meta_info"]["output_token_logprobs"]
        ids = [int(entry[1]) for entry in out]
        tokens.append(prompt + ids)
        lengths.append(len(ids))
        log_probs.append([float(entry[0]) for entry in out])
        experts = int32_meta_array(answer["meta_info"], "routed_experts")
        routed.append(experts.reshape(len(prompt) + len(ids) - 1, LAYERS, TOP_K).clone())
    n = len(prompts)
    return RolloutBatch(
        tokens, lengths, [0.0] * n, list(range(n)), None, log_probs, rollout_routed_experts=routed
    )


def trainer_log_probs(model: str, batch: RolloutBatch, replay: bool, tmp: str) -> dict[int, list[float]]:
    from slime.backends.fsdp.actor import FSDPTrainActor
    from slime.config.train import BatchConfig, MoEOptions, TrainConfig

    cfg = TrainConfig(
        hf_checkpoint=model,
        batch=BatchConfig(global_batch_size=len(batch), micro_batch_size=math.gcd(len(batch), 8)),
        moe=MoEOptions(use_rollout_routing_replay=replay),
    )
    rendezvous = os.path.join(tmp, f"rendezvous-{int(replay)}-{id(batch)}")
    actor = FSDPTrainActor(cfg, 0, 1, f"file://{rendezvous}")
    actor.init()
    try:
        return actor.compute_log_probs(batch)
    finally:
        actor.close()


def own_routing(model: str, batch: RolloutBatch) -> list[torch.Tensor]:
    """The experts the float32 Hugging Face model routes each fed token to: [tokens - 1, layers, k],
    -1 in a dense layer."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    routers = {
        li: layer.mlp.gate for li, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")
    }
    out = []
    for tokens in batch.tokens:
        chosen = torch.full((len(tokens) - 1, LAYERS, TOP_K), -1, dtype=torch.int32)

        def keep(li: int, experts: torch.Tensor, got: torch.Tensor = chosen) -> None:
            got[:, li] = experts

        hooks = [
            gate.register_forward_hook(lambda m, a, o, li=li, keep=keep: keep(li, o[2]))
            for li, gate in routers.items()
        ]
        with torch.no_grad():
            hf(torch.tensor([tokens[:-1]]))
        for h in hooks:
            h.remove()
        out.append(chosen)
    return out


def differing(own: list[torch.Tensor], engine: list) -> tuple[int, int]:
    """(routings where the trainer's own top-k set differs from the engine's, routings) over the
    MoE layers."""
    moe = own[0][0] >= 0  # [layers, k]: the MoE layers
    differ = routings = 0
    for o, e in zip(own, engine):
        e = torch.as_tensor(e)
        changed = (o.sort(-1).values != e.sort(-1).values).any(-1)  # [tokens, layers]
        differ += int(changed[:, moe[:, 0]].sum())
        routings += o.shape[0] * int(moe[:, 0].sum())
    return differ, routings


def build(arch: str, tmp: str) -> str:
    model = os.path.join(tmp, arch)
    make_tiny_model(
        [
            "--out",
            model,
            "--arch",
            arch,
            "--hidden-size",
            "128",
            "--num-layers",
            str(LAYERS),
            "--num-heads",
            "4",
            "--num-kv-heads",
            "2",
            "--num-experts",
            str(EXPERTS),
            "--num-experts-per-tok",
            str(TOP_K),
            "--moe-intermediate-size",
            "64",
        ]
    )
    return model


def gaps(batch: RolloutBatch, trainer: dict[int, list[float]]) -> torch.Tensor:
    assert batch.rollout_log_probs is not None
    return torch.cat(
        [
            (torch.tensor(trainer[i]) - torch.tensor(batch.rollout_log_probs[i])).abs()
            for i in range(len(batch))
        ]
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", nargs="+", default=["qwen3_moe"], choices=[*MOE_FAMILIES, "all"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="bench_r3_")
    archs = list(MOE_FAMILIES) if "all" in args.arch else args.arch
    rows = []
    for arch in archs:
        model = build(arch, tmp)
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(model).vocab_size
        g = torch.Generator().manual_seed(args.seed)
        prompts = [
            torch.randint(4, vocab, (int(torch.randint(8, 33, (1,), generator=g)),), generator=g).tolist()
            for _ in range(args.requests)
        ]
        for dtype in ("float32", "bfloat16"):
            batch = rollout(model, dtype, prompts, args.new_tokens, args.threads, tmp)
            assert batch.rollout_routed_experts is not None
            differ, routings = differing(own_routing(model, batch), batch.rollout_routed_experts)
            plain = gaps(batch, trainer_log_probs(model, batch, False, tmp))
            replay = gaps(batch, trainer_log_probs(model, dataclasses.replace(batch), True, tmp))
            rows.append((arch, dtype, differ / routings, plain, replay))

    print(
        f"\nmodels: tiny, hidden 128, {LAYERS} layers, {EXPERTS} experts, top-{TOP_K}; {args.requests} "
        f"requests x {args.new_tokens} sampled tokens (seed {args.seed}), {args.threads} threads"
    )
    header = (
        "family        | engine dtype | routing differs | |gap| mean / p99 / max, no R3 | with R3 | max ratio"
    )
    print(header)
    print("-" * len(header))
    for arch, dtype, share, plain, replay in rows:

        def stats(x: torch.Tensor) -> str:
            return f"{x.mean():.2e} / {x.quantile(0.99):.2e} / {x.max():.2e}"

        ratio = float(plain.max() / replay.max()) if replay.max() > 0 else float("inf")
        print(
            f"{arch:<13} | {dtype:<12} | {share:>14.2%} | {stats(plain):>30} | {stats(replay)} | {ratio:.1f}x"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
