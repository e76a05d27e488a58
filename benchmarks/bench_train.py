"""FSDP train actor (1 rank) against a plain single-process PyTorch loop doing the same work.

    python benchmarks/bench_train.py [--model-path DIR] [--threads 2] [--rollouts 3]

Workload per rollout: 64 samples (prompt 16-48 tokens, response 32-96, fixed seed), global
batch 32 (two optimizer steps), micro-batches of 8, GRPO policy loss, AdamW. Both sides run a
no-grad log-prob pass over the rollout, then forward/backward/step over the same micro-batches
with the same loss function, so the ratio measures what the FSDP actor adds (sharding hooks,
planning, metrics). Reported: median tokens/s over --rollouts after one warm-up rollout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from slime.algo import advantages as adv
from slime.algo.losses import token_weights
from slime.algo.objective import LossConfig, MicroBatchTerms, micro_batch_loss
from slime.backends.fsdp.forward import response_log_probs
from slime.backends.micro_batch import make_micro_batch
from slime.config.train import BatchConfig, OptimizerConfig, TrainConfig
from slime.tools.make_tiny_model import main as make_tiny_model
from slime.utils import step_plans
from slime.utils.rollout_batch import RolloutBatch

GLOBAL_BATCH, MICRO_BATCH, NUM_SAMPLES = 32, 8, 64


def make_rollout(seed: int, vocab: int) -> RolloutBatch:
    g = torch.Generator().manual_seed(seed)
    tokens, resp, rewards = [], [], []
    for _ in range(NUM_SAMPLES):
        p, r = int(torch.randint(16, 49, (1,), generator=g)), int(torch.randint(32, 97, (1,), generator=g))
        tokens.append(torch.randint(4, vocab, (p + r,), generator=g).tolist())
        resp.append(r)
        rewards.append(float(torch.rand((), generator=g) > 0.5))
    return RolloutBatch(tokens, resp, rewards, [i // 8 for i in range(NUM_SAMPLES)])


def plain_loop(model, optimizer, batch: RolloutBatch, loss_cfg: LossConfig) -> None:
    """The same algorithm as FSDPTrainActor.train, written as a bare loop on one model."""
    steps = step_plans.split_steps(len(batch), GLOBAL_BATCH)
    mbs = [[step_plans.fixed_micro_batches(step, MICRO_BATCH)] for step in steps]
    old = {}
    with torch.no_grad():
        for step_mbs in mbs:
            for positions in step_mbs[0]:
                mb = make_micro_batch(
                    positions, batch.tokens, batch.response_lengths, None, torch.device("cpu"), packed=True
                )
                lp, _ = response_log_probs(model, mb, 1.0, False)
                for row, p in enumerate(positions):
                    old[p] = lp[row, : mb.response_lengths[row]]
    scalars = adv.normalize_group_rewards(batch.rewards, batch.group_indices, "grpo")
    for step, step_mbs in zip(steps, mbs):
        optimizer.zero_grad(set_to_none=True)
        num_tokens = sum(batch.response_lengths[i] for i in step)
        for positions in step_mbs[0]:
            mb = make_micro_batch(
                positions, batch.tokens, batch.response_lengths, None, torch.device("cpu"), packed=True
            )
            lp, ent = response_log_probs(model, mb, 1.0, True)
            terms = MicroBatchTerms(
                log_probs=lp,
                mask=mb.loss_mask,
                weights=token_weights(mb.loss_mask, False, len(step), num_tokens),
                old_log_probs=mb.response_tensor([old[p] for p in positions]),
                advantages=mb.response_tensor(
                    [scalars[p].repeat(batch.response_lengths[p]) for p in positions]
                ),
                entropy=ent.detach(),
            )
            loss, _ = micro_batch_loss(loss_cfg, terms)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


def measure(run, rollouts: int, vocab: int) -> tuple[float, list[float]]:
    run(make_rollout(100, vocab))  # warm-up
    rates = []
    for r in range(rollouts):
        batch = make_rollout(r, vocab)
        tokens = sum(len(t) for t in batch.tokens)  # each rollout's own (lengths are drawn per seed)
        start = time.perf_counter()
        run(batch)
        rates.append(tokens / (time.perf_counter() - start))
    return statistics.median(rates), rates


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model-path", default=None, help="HF checkpoint (default: build a 6-layer, 384-wide Qwen3)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rollouts", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tmp = tempfile.mkdtemp(prefix="bench-train-")
    model_path = args.model_path or os.path.join(tmp, "model")
    if args.model_path is None:
        make_tiny_model(
            ["--out", model_path, "--hidden-size", "384", "--num-layers", "6", "--num-heads", "6"]
        )

    from transformers import AutoModelForCausalLM

    from slime.backends.fsdp.actor import FSDPTrainActor

    loss_cfg = LossConfig()
    opt_cfg = OptimizerConfig(lr=1e-5)
    from slime.backends.packed_attention import register

    # The actor's layout: packed micro-batches, slime's per-sample attention (docs/train.md).
    model = AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32, attn_implementation=register()
    )
    model.train()
    vocab = model.config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr)

    def run_plain(batch: RolloutBatch) -> None:
        plain_loop(model, optimizer, batch, loss_cfg)

    base_rate, base_all = measure(run_plain, args.rollouts, vocab)

    cfg = TrainConfig(
        hf_checkpoint=model_path,
        loss=loss_cfg,
        optimizer=opt_cfg,
        batch=BatchConfig(global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO_BATCH),
    )
    actor = FSDPTrainActor(cfg, 0, 1, f"file://{os.path.join(tmp, 'rendezvous')}")
    info = actor.init()
    rollout_ids = iter(range(10_000))
    fsdp_rate, fsdp_all = measure(lambda b: actor.train(next(rollout_ids), b), args.rollouts, vocab)
    actor.close()

    print(f"model: {info['num_parameters'] / 1e6:.1f} M parameters, threads {args.threads}")
    print(f"{'trainer':<28}{'tokens/s (median)':>20}  runs")
    print(f"{'plain PyTorch loop':<28}{base_rate:>20,.0f}  {', '.join(f'{r:,.0f}' for r in base_all)}")
    print(f"{'FSDP actor, 1 rank':<28}{fsdp_rate:>20,.0f}  {', '.join(f'{r:,.0f}' for r in fsdp_all)}")
    print(f"overhead ratio (plain / FSDP time per token): {base_rate / fsdp_rate:.3f}  (target <= 1.15)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
