"""The FSDP2 train actor on real gloo process groups: N ranks train exactly like one.

Three runs share one tiny model and one sequence of rollouts:
- one rank, fixed micro-batches of 2, five rollouts of two optimizer steps each;
- two ranks, dynamic micro-batches under a small token budget (so ranks get different
  numbers of real micro-batches and pad with dummy ones), a checkpoint after rollout 2; odd
  rollouts reach each rank as its part (`split_rollout`, as the rollout manager sends them),
  even ones whole;
- one rank resumed from the two-rank checkpoint, training rollouts 3 and 4.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import pytest
import torch

from slime.algo.objective import LossConfig
from slime.config.train import BatchConfig, OptimizerConfig, TrainConfig
from slime.utils.rollout_batch import RolloutBatch, split_rollout
from tests.dist_helpers import run_ranks

NUM_ROLLOUTS = 5
SAVE_AFTER = 2
PEAK = 0.5  # --peak-tflops of the padded run


def make_batch(seed: int, num_samples: int = 8, group: int = 4, vocab: int = 101) -> RolloutBatch:
    """Random prompts/responses with rewards, loss masks and engine log-probs (perturbed)."""
    g = torch.Generator().manual_seed(seed)
    tokens, resp, rewards, groups, masks, rollout_lp = [], [], [], [], [], []
    for i in range(num_samples):
        p = int(torch.randint(2, 12, (1,), generator=g))
        r = int(torch.randint(1, 14, (1,), generator=g))
        tokens.append(torch.randint(4, vocab, (p + r,), generator=g).tolist())
        resp.append(r)
        rewards.append(float(torch.rand((), generator=g) > 0.5))
        groups.append(i // group)
        mask = [1] * r
        if r > 3:
            mask[1] = 0  # a token excluded from the loss (e.g. tool output)
        masks.append(mask)
        rollout_lp.append((-4.6 + 0.05 * torch.randn(r, generator=g)).tolist())
    return RolloutBatch(tokens, resp, rewards, groups, masks, rollout_lp)


FANNED_OUT = 3
"""The rollout whose executions were split into several samples (an agent's sessions)."""


def rollout_batch(r: int) -> RolloutBatch:
    """Rollout `r`'s batch. Rollout FANNED_OUT holds 11 samples of 8 executions: a step of
    --global-batch-size 4 executions then holds 7 samples, which two ranks split 4 and 3."""
    if r != FANNED_OUT:
        return make_batch(r)
    executions = [0, 0, 1, 2, 2, 2, 3, 4, 5, 6, 7]
    batch = make_batch(r, num_samples=len(executions))
    batch.rollout_ids = [100 + e for e in executions]
    batch.group_indices = [e // 4 for e in executions]
    batch.rewards = [float(e % 3 == 0) for e in executions]  # a session's reward on each of its samples
    return batch


def base_config(model: str, **batch) -> TrainConfig:
    return TrainConfig(
        hf_checkpoint=model,
        loss=LossConfig(
            use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01, use_tis=True, eps_clip_high=0.28
        ),
        # Megatron-LM's warm-up starts at --lr-warmup-init (0 by default: a first step that moves nothing).
        optimizer=OptimizerConfig(
            lr=1e-4, lr_warmup_iters=2, lr_warmup_init=2e-5, lr_decay_style="cosine", lr_decay_iters=20
        ),
        batch=BatchConfig(global_batch_size=4, **batch),
    )


def full_params(actor) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in actor.backend.model.named_parameters()}


def run_single(rank, world_size, init_method, model, padded=False, peak=None):
    from slime.backends.fsdp.actor import FSDPTrainActor

    cfg = base_config(model, micro_batch_size=2, padded_micro_batches=padded)
    cfg = dataclasses.replace(cfg, peak_tflops=peak)  # --peak-tflops: MFU on a CPU too
    actor = FSDPTrainActor(cfg, rank, world_size, init_method)
    info = actor.init()
    initial = full_params(actor)
    step0 = make_batch(0)
    actor_lp = actor.compute_log_probs(step0)
    ref_lp = actor.compute_log_probs(step0, use_reference=True)
    outputs = [actor.train(r, rollout_batch(r)) for r in range(NUM_ROLLOUTS)]
    result = dict(
        info=info,
        initial=initial,
        final=full_params(actor),
        outputs=outputs,
        actor_lp=actor_lp,
        ref_lp=ref_lp,
    )
    actor.close()
    return result


def run_sharded(rank, world_size, init_method, model, save_dir, hf_dir):
    from slime.backends.fsdp.actor import FSDPTrainActor

    actor = FSDPTrainActor(
        base_config(model, use_dynamic_batch_size=True, max_tokens_per_gpu=32), rank, world_size, init_method
    )
    info = actor.init()
    initial = full_params(actor)
    plans = [actor.plan(rollout_batch(r)) for r in range(NUM_ROLLOUTS)]
    outputs = []
    for r in range(NUM_ROLLOUTS):
        batch = rollout_batch(r)
        data = split_rollout(batch, actor.cfg.batch, world_size)[rank] if r % 2 else batch
        outputs.append(actor.train(r, data))
        if r == SAVE_AFTER:
            actor.save(r, save_dir)
    actor.save_hf(hf_dir)
    buckets = [[(n, t.clone()) for n, t in b] for b in actor.export_weights(bucket_bytes=300_000)]
    result = dict(
        info=info, initial=initial, final=full_params(actor), outputs=outputs, plans=plans, buckets=buckets
    )
    actor.close()
    return result


def run_resumed(rank, world_size, init_method, model, save_dir):
    from slime.backends.fsdp.actor import FSDPTrainActor

    cfg = dataclasses.replace(base_config(model, micro_batch_size=2), load=save_dir)
    actor = FSDPTrainActor(cfg, rank, world_size, init_method)
    info = actor.init()
    outputs = [actor.train(r, rollout_batch(r)) for r in range(SAVE_AFTER + 1, NUM_ROLLOUTS)]
    result = dict(info=info, outputs=outputs, final=full_params(actor))
    actor.close()
    return result


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    save_dir, hf_dir = str(tmp / "ckpt"), str(tmp / "hf")
    single = run_ranks(1, run_single, tiny_model)[0]
    sharded = run_ranks(2, run_sharded, tiny_model, save_dir, hf_dir)
    resumed = run_ranks(1, run_resumed, tiny_model, save_dir)[0]
    padded = run_ranks(1, run_single, tiny_model, True, PEAK)[0]
    return dict(
        single=single, sharded=sharded, resumed=resumed, padded=padded, save_dir=save_dir, hf_dir=hf_dir
    )


# ppo_kl and kl_loss are differences of two log-probs of about -4.6: float32 rounding of the
# log-probs (~5e-7) is their floor, so they compare with an absolute tolerance instead.
DIFFERENCE_METRICS = {"ppo_kl", "kl_loss"}


def close(a: float, b: float, metric: str = "") -> bool:
    if metric in DIFFERENCE_METRICS:
        return abs(a - b) <= 1e-6
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-7)


def assert_steps_match(steps_a, steps_b):
    assert len(steps_a) == len(steps_b)
    for k, (a, b) in enumerate(zip(steps_a, steps_b)):
        assert a.keys() == b.keys()
        bad = {m: (a[m], b[m]) for m in a if not close(a[m], b[m], m)}
        assert not bad, f"step {k}: {bad}"


def test_meta_init_gives_every_rank_the_single_process_weights(runs, hf_model):
    expected = dict(hf_model.named_parameters())
    for result in [runs["single"], *runs["sharded"]]:
        assert result["initial"].keys() == expected.keys()
        for name, value in result["initial"].items():
            assert torch.equal(value, expected[name].detach()), name


def test_two_ranks_train_like_one(runs):
    single, (rank0, rank1) = runs["single"], runs["sharded"]
    steps_1 = [s for out in single["outputs"] for s in out.steps]
    for rank_result in (rank0, rank1):
        steps_2 = [s for out in rank_result["outputs"] for s in out.steps]
        assert len(steps_1) == 2 * NUM_ROLLOUTS
        assert_steps_match(steps_1, steps_2)
        for out_1, out_2 in zip(single["outputs"], rank_result["outputs"]):
            for key, value in out_1.rollout.items():
                assert close(value, out_2.rollout[key], key), key
    for name, value in single["final"].items():
        assert (value - single["initial"][name]).abs().max() > 0, f"{name} never changed"
        torch.testing.assert_close(rank0["final"][name], value, rtol=0, atol=1e-5)
        assert torch.equal(rank0["final"][name], rank1["final"][name])


def test_padded_micro_batches_train_like_packed(runs):
    """One rank with --padded-micro-batches (one padded row per sample) trains like one rank and
    two ranks with packed micro-batches (the default): same metrics at every step, same weights."""
    single, padded = runs["single"], runs["padded"]
    steps_padded = [s for out in padded["outputs"] for s in out.steps]
    for run in (single, runs["sharded"][0]):
        assert_steps_match([s for out in run["outputs"] for s in out.steps], steps_padded)
    for name, value in single["final"].items():
        torch.testing.assert_close(padded["final"][name], value, rtol=0, atol=1e-5)
    assert padded["actor_lp"] == padded["ref_lp"]
    assert padded["outputs"][0].steps[0]["kl_loss"] == 0.0


def test_dynamic_batches_pack_and_keep_ranks_in_step(runs):
    # The two-rank run is only a strong test if the token budget really packed and split.
    plans_0, plans_1 = runs["sharded"][0]["plans"], runs["sharded"][1]["plans"]
    steps = [(s0, s1) for p0, p1 in zip(plans_0, plans_1) for s0, s1 in zip(p0, p1)]
    assert all(len(s0.micro_batches) == len(s1.micro_batches) for s0, s1 in steps)
    sizes = [len(mb) for s0, s1 in steps for mb in (*s0.micro_batches, *s1.micro_batches)]
    assert 1 in sizes and 2 in sizes
    assert any(len(s0.micro_batches) == 1 for s0, _ in steps)


def test_sessions_split_into_samples_step_by_execution(runs):
    """The fanned-out rollout (trained like one rank in test_two_ranks_train_like_one): its first
    step holds 4 executions in 7 samples, which the ranks split 4 and 3 and still run in step."""
    plans = [rank["plans"][FANNED_OUT] for rank in runs["sharded"]]
    for k, (s0, s1) in enumerate(zip(*plans)):
        assert s0.num_executions == s1.num_executions == 4
        assert s0.num_samples == (7, 4)[k] and len(s0.micro_batches) == len(s1.micro_batches)
        held = sorted(sum(map(len, s.micro_batches)) for s in (s0, s1))
        assert held == ([3, 4], [2, 2])[k]
    assert plans[0][0].denominators is not None
    # A rank's samples are normalised by their whole execution's loss tokens (the plans were
    # made from the whole rollout: positions are the rollout's).
    batch = rollout_batch(FANNED_OUT)
    assert batch.loss_masks is not None and batch.rollout_ids is not None
    for plan in plans:
        for position, total in plan[0].denominators.items():
            siblings = [g for g in range(7) if batch.rollout_ids[g] == batch.rollout_ids[position]]
            assert total == sum(sum(batch.loss_masks[g]) for g in siblings)


def test_step0_reference_equals_actor_bitwise_and_kl_is_zero(runs):
    single = runs["single"]
    assert single["actor_lp"].keys() == single["ref_lp"].keys()
    for k, values in single["actor_lp"].items():
        assert values == single["ref_lp"][k]
        assert all(v < 0 and math.isfinite(v) for v in values)
    first = single["outputs"][0].steps[0]
    assert first["ppo_kl"] == 0.0 and first["kl_loss"] == 0.0
    assert first["pg_clipfrac"] == 0.0
    assert single["outputs"][0].steps[1]["kl_loss"] != 0.0  # the second step moved away


def test_memory_per_rank_halves(runs):
    one = runs["single"]["info"]["local_state_bytes"]
    two = [r["info"]["local_state_bytes"] for r in runs["sharded"]]
    assert all(0.45 < b / one < 0.55 for b in two), (one, two)


def test_checkpoint_from_two_ranks_resumes_on_one(runs):
    resumed = runs["resumed"]
    assert resumed["info"]["resumed_rollout_id"] == SAVE_AFTER
    single_steps = [s for out in runs["single"]["outputs"][SAVE_AFTER + 1 :] for s in out.steps]
    assert_steps_match(single_steps, [s for out in resumed["outputs"] for s in out.steps])
    for name, value in runs["single"]["final"].items():
        torch.testing.assert_close(resumed["final"][name], value, rtol=0, atol=1e-5)
    entries = sorted(os.listdir(runs["save_dir"]))
    assert entries == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def test_save_hf_loads_with_automodel(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(runs["hf_dir"], dtype=torch.float32)
    final = runs["sharded"][0]["final"]
    loaded = dict(model.named_parameters())
    assert loaded.keys() == final.keys()
    for name, value in final.items():
        assert torch.equal(loaded[name].detach(), value), name
    assert len(AutoTokenizer.from_pretrained(runs["hf_dir"])) == 101


def test_export_buckets_cover_every_parameter_once_within_budget(runs):
    rank0 = runs["sharded"][0]
    buckets = rank0["buckets"]
    names = [n for b in buckets for n, _ in b]
    assert sorted(names) == sorted(rank0["final"])
    assert len(buckets) > 3
    for b in buckets:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= 300_000 or len(b) == 1
    for bucket in buckets:
        for name, tensor in bucket:
            assert torch.equal(tensor, rank0["final"][name])
    assert [n for b in runs["sharded"][1]["buckets"] for n, _ in b] == names


def assert_perf(outputs, batches, model: str, num_gpus: int, peak: float | None = None) -> None:
    """slime's perf/* of each train call: tokens trained per second over all ranks, TFLOPS per
    GPU from the model's FLOPs count (their ratio is the count per token and GPU, whatever the
    time), MFU only with a peak."""
    from slime.utils import flops

    counted = flops.from_config(json.load(open(os.path.join(model, "config.json"))))
    for output, batch in zip(outputs, batches, strict=True):
        perf = output.perf
        keys = {"actor_train_tok_per_s", "actor_train_tflops", "log_probs_tflops", "ref_log_probs_tflops"}
        assert perf.keys() == keys | ({"actor_train_mfu"} if peak else set()), perf
        assert perf["actor_train_tok_per_s"] > 0 and perf["log_probs_tflops"] > 0
        lengths = [len(t) for t in batch.tokens]  # every sample of the rollout, prompt and response
        per_token = counted.train_flops(lengths) / num_gpus / 1e12 / sum(lengths)
        assert math.isclose(
            perf["actor_train_tflops"] / perf["actor_train_tok_per_s"], per_token, rel_tol=1e-9
        )
        if peak:
            assert perf["actor_train_mfu"] == perf["actor_train_tflops"] / peak


def test_each_train_call_reports_slimes_perf_metrics(runs, tiny_model):
    """On CPU: no MFU (no known peak) unless --peak-tflops gives one; two ranks share the FLOPs."""
    batches = [rollout_batch(r) for r in range(NUM_ROLLOUTS)]
    assert_perf(runs["single"]["outputs"], batches, tiny_model, 1)
    assert_perf(runs["sharded"][0]["outputs"], batches, tiny_model, 2)  # odd rollouts came as parts
    assert_perf(runs["padded"]["outputs"], batches, tiny_model, 1, PEAK)
