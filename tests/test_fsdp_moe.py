"""The FSDP actor with a mixture-of-experts model (tiny Qwen3-MoE, 4 experts, top-2).

transformers fuses each layer's experts into two parameters while checkpoints hold one tensor
per expert (slime.utils.hf_experts): every rank reads only its own experts from the files, two
ranks train like one, and whatever leaves the actor (weight export, --save-hf) carries the
checkpoint's per-expert names.
"""

from __future__ import annotations

import glob

import pytest
import torch

from slime.backends.fsdp import model_init
from slime.utils import hf_experts
from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import NUM_ROLLOUTS, assert_steps_match, run_sharded, run_single
from tests.test_routing_families import forced_log_probs, moe_actor, r3_log_probs


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in glob.glob(f"{path}/*.safetensors"):
        out.update(load_file(f))
    return out


@pytest.fixture(scope="module")
def hf_moe(tiny_moe):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_moe, dtype=torch.float32).eval()


@pytest.mark.parametrize("world_size", [2, 3])
def test_each_rank_reads_its_experts_from_per_expert_files(tiny_moe, hf_moe, world_size, monkeypatch):
    """No whole-checkpoint fallback: the fused expert rows come from the per-expert tensors
    (3 ranks over 4 experts: 2, 2 and none)."""

    def no_fallback(*args):
        raise AssertionError("read_local_shards fell back to from_pretrained")

    monkeypatch.setattr(model_init, "_shards_via_from_pretrained", no_fallback)
    meta = model_init.build_meta_model(hf_moe.config, "sdpa")
    for rank in range(world_size):
        shards = model_init.read_local_shards(meta, tiny_moe, rank, world_size)
        for name, param in hf_moe.named_parameters():
            start, end = model_init.shard_rows(param.shape[0], rank, world_size)
            assert torch.equal(shards[name], param.detach()[start:end]), name
    assert "model.layers.0.mlp.experts.gate_up_proj" in shards


def test_checkpoint_names_split_fused_experts_and_back(hf_moe, tiny_moe):
    params = dict(hf_moe.named_parameters())
    on_disk = checkpoint_tensors(tiny_moe)
    named = dict(hf_experts.checkpoint_tensors("qwen3_moe", params.items()))
    assert named.keys() == on_disk.keys()
    for name, value in on_disk.items():
        assert torch.equal(named[name], value), name
    shapes = hf_experts.checkpoint_shapes("qwen3_moe", {n: tuple(p.shape) for n, p in params.items()})
    assert shapes == {n: tuple(t.shape) for n, t in on_disk.items()}
    # A dense family passes through untouched, even with a parameter of the same name.
    assert dict(hf_experts.checkpoint_tensors("gpt_oss", params.items())).keys() == params.keys()


@pytest.fixture(scope="module")
def runs(tiny_moe, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp-moe")
    save_dir, hf_dir = str(tmp / "ckpt"), str(tmp / "hf")
    single = run_ranks(1, run_single, tiny_moe)[0]
    sharded = run_ranks(2, run_sharded, tiny_moe, save_dir, hf_dir)
    return dict(single=single, sharded=sharded, hf_dir=hf_dir)


def test_two_ranks_train_moe_like_one(runs, hf_moe):
    single, (rank0, rank1) = runs["single"], runs["sharded"]
    for name, value in hf_moe.named_parameters():
        assert torch.equal(single["initial"][name], value.detach()), name
    steps_1 = [s for out in single["outputs"] for s in out.steps]
    assert len(steps_1) == 2 * NUM_ROLLOUTS
    for rank_result in (rank0, rank1):
        assert_steps_match(steps_1, [s for out in rank_result["outputs"] for s in out.steps])
    experts = "model.layers.1.mlp.experts.gate_up_proj"
    for name, value in single["final"].items():
        assert (value - single["initial"][name]).abs().max() > 0, f"{name} never changed"
        torch.testing.assert_close(rank0["final"][name], value, rtol=0, atol=1e-5)
        assert torch.equal(rank0["final"][name], rank1["final"][name])
    # Every expert was routed to and trained.
    moved = (single["final"][experts] - single["initial"][experts]).flatten(1).abs().amax(1)
    assert bool((moved > 0).all()), moved
    assert single["actor_lp"] == single["ref_lp"]
    assert single["outputs"][0].steps[0]["kl_loss"] == 0.0


def test_export_and_save_hf_use_per_expert_names(runs, tiny_moe):
    from transformers import AutoModelForCausalLM

    rank0 = runs["sharded"][0]
    final = dict(hf_experts.checkpoint_tensors("qwen3_moe", rank0["final"].items()))
    expected_names = sorted(checkpoint_tensors(tiny_moe))
    exported = {n: t for b in rank0["buckets"] for n, t in b}
    assert sorted(exported) == expected_names
    for name, tensor in exported.items():
        assert torch.equal(tensor, final[name]), name
    saved = checkpoint_tensors(runs["hf_dir"])
    assert sorted(saved) == expected_names
    loaded = dict(
        AutoModelForCausalLM.from_pretrained(runs["hf_dir"], dtype=torch.float32).named_parameters()
    )
    for name, value in rank0["final"].items():
        assert torch.equal(loaded[name].detach(), value), name


def replay_rank(rank, world_size, init_method, model):
    import dataclasses

    from slime.backends.fsdp import moe
    from tests.test_engine_moe import hf_routing
    from tests.test_fsdp_actor import make_batch

    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    batch = make_batch(0)
    own = [hf_routing(hf, t[:-1]) for t in batch.tokens]
    rotated = [(r + 1) % 4 for r in own]  # another routing: every expert id shifted by one
    out = {}

    def actor_with(**flags):
        return moe_actor(model, rank, world_size, init_method, **flags)

    out.update(r3_log_probs(actor_with, batch, own, rotated))
    actor = actor_with(use_rollout_routing_replay=True)
    try:
        actor.compute_log_probs(dataclasses.replace(batch, rollout_routed_experts=[r[:-1] for r in own]))
    except Exception as e:
        out["short_table"] = str(e)
    actor.close()

    # R2: the training steps replay what the log-prob pass recorded (spied on the hooks).
    seen = []
    original = moe.Routing.micro_batch

    def spy(self, replay=None, record=False, aux=False):
        seen.append((None if replay is None else replay.clone(), record, aux))
        return original(self, replay, record, aux)

    moe.Routing.micro_batch = spy
    actor = actor_with(use_routing_replay=True, moe_aux_loss_coeff=0.01)
    plans = actor.plan(batch)
    result = actor.train(0, batch)
    moe.Routing.micro_batch = original
    out["r2_seen"] = seen
    out["r2_plans"] = [[list(mb) for mb in step.micro_batches] for step in plans]
    out["r2_steps"] = result.steps
    out["own"] = own
    out["rotated"] = rotated
    actor.close()
    return out


@pytest.fixture(scope="module")
def replay(tiny_moe):
    return run_ranks(1, replay_rank, tiny_moe)[0]


def test_rollout_routing_replay_routes_as_told(replay, hf_moe):
    """R3: replaying the routing the model would choose changes nothing (bitwise); replaying
    another one gives exactly the log-probs of a forward forced to those experts."""
    from tests.test_fsdp_actor import make_batch

    batch = make_batch(0)
    assert replay["r3_own"] == replay["plain"]
    for i, (tokens, r) in enumerate(zip(batch.tokens, batch.response_lengths)):
        table = torch.cat(
            [replay["rotated"][i], replay["own"][i][-1:]]
        )  # last token: any (not predicted from)
        expected = forced_log_probs(hf_moe, tokens, r, table)  # (tests/test_routing_families.py)
        assert torch.allclose(torch.tensor(replay["r3_rotated"][i]), expected, atol=1e-5, rtol=0), i
        assert max(abs(a - b) for a, b in zip(replay["r3_rotated"][i], replay["plain"][i])) > 1e-3
    assert "'rollout_routed_experts': shape" in replay["short_table"]


def test_routing_replay_r2_and_the_aux_loss(replay, hf_moe):
    """R2: the log-prob pass records each token's experts (those Hugging Face routes to) and every
    training micro-batch replays them; --moe-aux-loss-coeff adds megatron-core's aux_loss,
    checked against a hand computation from Hugging Face's router probabilities."""
    from tests.test_fsdp_actor import make_batch

    batch = make_batch(0)
    seen, plans = replay["r2_seen"], replay["r2_plans"]
    micro_batches = [mb for step in plans for mb in step]
    n = len(micro_batches)
    log_prob_pass, ref_pass, train_steps = seen[:n], seen[n : 2 * n], seen[2 * n :]
    assert all(record and replay_t is None and not aux for replay_t, record, aux in log_prob_pass)
    assert len(train_steps) == n
    # The reference pass (--use-kl-loss) replays too, so step-0 KL stays exactly 0.
    for (table, record, _), positions in [*zip(ref_pass, micro_batches), *zip(train_steps, micro_batches)]:
        assert not record and table is not None
        start = 0
        for p in positions:  # packed: the samples back to back
            length = len(batch.tokens[p])
            assert torch.equal(table[start : start + length - 1].int(), replay["own"][p]), p
            start += length
    assert all(aux for _, _, aux in train_steps) and not any(aux for _, _, aux in ref_pass)
    assert replay["r2_steps"][0]["kl_loss"] == 0.0
    # aux_loss of the first step, by hand: per micro-batch and MoE layer, E/(k T^2) sum_e P_e n_e.
    expected = 0.0
    step_samples = sum(len(mb) for mb in plans[0])
    for positions in plans[0]:
        per_layer: dict[int, list[torch.Tensor]] = {}
        hooks = [
            layer.mlp.gate.register_forward_hook(
                lambda m, a, out, li=li, got=per_layer: got.setdefault(li, []).append(
                    out[0].float().softmax(-1)
                )
            )
            for li, layer in enumerate(hf_moe.model.layers)
        ]
        with torch.no_grad():
            for p in positions:
                hf_moe(torch.tensor([batch.tokens[p]]))
        for h in hooks:
            h.remove()
        for probs in per_layer.values():
            probs = torch.cat(probs)
            counts = torch.bincount(probs.topk(2, dim=-1).indices.flatten(), minlength=4).float()
            tokens = probs.shape[0]
            expected += (
                float((probs.sum(0) * counts).sum())
                * 4
                / (2 * tokens * tokens)
                * len(positions)
                / step_samples
            )
    assert abs(replay["r2_steps"][0]["moe_aux_loss"] - expected) < 1e-5
