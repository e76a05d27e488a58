"""Routing replay (R3, R2) and the float64 router on the FSDP actor for the sigmoid-routed
families (an expert bias, expert groups, a routed scaling factor: GLM-4.5+, DeepSeek-V3,
GLM-4.7-Flash) and the hybrid ones (a gated shared expert: Qwen3-Next, Qwen3.5-MoE), against
Hugging Face's forward of each tiny family (Qwen3-MoE: tests/test_fsdp_moe.py; the Megatron
actor: tests/test_megatron_moe_actor.py)."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from tests.dist_helpers import run_ranks

DEFAULT = ("glm4_moe", "qwen3_5_moe", "qwen3_next")  # sigmoid with two groups; hybrid routers
SLOW = ("deepseek_v3", "glm4_moe_lite")


def routers(model) -> dict[int, torch.nn.Module]:
    return {
        li: layer.mlp.gate
        for li, layer in enumerate(model.model.layers)
        if hasattr(getattr(layer.mlp, "gate", None), "top_k")
    }


def own_routing(model, tokens: list[int]) -> torch.Tensor:
    """The experts Hugging Face's forward routes each token to: [tokens, layers, k], -1 in dense
    layers."""
    chosen: dict[int, torch.Tensor] = {}
    hooks = [
        gate.register_forward_hook(lambda m, a, out, li=li: chosen.__setitem__(li, out[2]))
        for li, gate in routers(model).items()
    ]
    with torch.no_grad():
        model(torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    k = next(iter(chosen.values())).shape[1]
    out = torch.full((len(tokens), len(model.model.layers), k), -1, dtype=torch.int32)
    for li, experts in chosen.items():
        out[:, li] = experts
    return out


def forced_log_probs(model, tokens: list[int], response_length: int, table: torch.Tensor) -> torch.Tensor:
    """Hugging Face's forward with each token routed to `table`'s experts, weighed as the model
    weighs its own choice: a sigmoid router by its sigmoid scores (renormalised when
    norm_topk_prob, times routed_scaling_factor), a softmax router by its probabilities
    renormalised over the k."""

    def hook(module, args, out, li):
        chosen = table[:, li].long()
        if hasattr(module, "e_score_correction_bias"):
            top = out[0].sigmoid().gather(1, chosen)
            if module.norm_topk_prob:
                top = top / (top.sum(-1, keepdim=True) + 1e-20)
            top = top * module.routed_scaling_factor
        else:
            top = out[0].softmax(-1, dtype=torch.float32).gather(1, chosen)
            top = top / top.sum(-1, keepdim=True)
        return out[0], top.to(out[1].dtype), chosen

    hooks = [
        g.register_forward_hook(lambda m, a, o, li=li: hook(m, a, o, li)) for li, g in routers(model).items()
    ]
    try:
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    lp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return lp[-response_length:]


def moe_actor(path: str, rank: int, world_size: int, init_method: str, **flags: Any) -> Any:
    """An FSDP actor of `path` with MoEOptions(**flags), initialised."""
    import dataclasses

    from slime.backends.fsdp.actor import FSDPTrainActor
    from slime.config.train import MoEOptions
    from tests.test_fsdp_actor import base_config

    cfg = dataclasses.replace(base_config(path, micro_batch_size=2), moe=MoEOptions(**flags))
    actor = FSDPTrainActor(cfg, rank, world_size, init_method)
    actor.init()
    return actor


def r3_log_probs(actor_with: Any, batch: Any, own: list, rotated: list) -> dict[str, Any]:
    """The log-probs of `batch`: plain, and under R3 with the model's own routing and another."""
    import dataclasses

    out = {}
    actor = actor_with()
    out["plain"] = actor.compute_log_probs(batch)
    actor.close()
    actor = actor_with(use_rollout_routing_replay=True)
    out["r3_own"] = actor.compute_log_probs(dataclasses.replace(batch, rollout_routed_experts=own))
    out["r3_rotated"] = actor.compute_log_probs(dataclasses.replace(batch, rollout_routed_experts=rotated))
    actor.close()
    return out


def _rank(rank, world_size, init_method, path):

    from transformers import AutoModelForCausalLM

    from slime.backends.fsdp import moe
    from tests.test_fsdp_actor import make_batch

    torch.set_num_threads(1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = make_batch(0)
    own = [own_routing(hf, t[:-1]) for t in batch.tokens]
    experts = int(next(iter(routers(hf).values())).num_experts)
    rotated = [torch.where(r >= 0, (r + 1) % experts, r) for r in own]  # every expert id shifted by one
    out = {"own": own, "rotated": rotated}

    def actor_with(**flags):
        return moe_actor(path, rank, world_size, init_method, **flags)

    out.update(r3_log_probs(actor_with, batch, own, rotated))
    seen = []  # R2: what the log-prob pass recorded and the training steps replayed
    original = moe.Routing.micro_batch

    def spy(self, replay=None, record=False, aux=False):
        with original(self, replay, record, aux) as state:
            yield state
        seen.append((None if replay is None else replay.clone(), state.record))

    moe.Routing.micro_batch = contextlib.contextmanager(spy)
    try:
        actor = actor_with(use_routing_replay=True, moe_aux_loss_coeff=0.01, moe_router_dtype="fp64")
        out["fp64"] = actor.compute_log_probs(batch)
        out["fp64_dtype"] = actor.backend.routing.dtype
        out["plans"] = [[list(mb) for mb in step.micro_batches] for step in actor.plan(batch)]
        # where each sample starts in its micro-batch (packed back to back, or one per padded row)
        out["starts"] = [
            actor.backend._micro_batch(batch, mb).token_starts() for step in out["plans"] for mb in step
        ]
        out["r2_steps"] = actor.train(0, batch).steps
    finally:
        moe.Routing.micro_batch = original
    actor.close()
    out["seen"] = seen
    return out


def _check(path, out):
    from transformers import AutoModelForCausalLM

    from tests.test_engine_server import teacher_forced_logprobs
    from tests.test_fsdp_actor import make_batch

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    batch = make_batch(0)
    # R3 with the model's own routing changes nothing, bit for bit: the replayed experts are
    # weighed exactly as the model weighs its own choice.
    assert out["r3_own"] == out["plain"]
    for i, (tokens, n) in enumerate(zip(batch.tokens, batch.response_lengths)):
        assert (
            torch.tensor(out["plain"][i]) - teacher_forced_logprobs(hf, tokens[:-n], tokens[-n:], 1.0)
        ).abs().max() < 1e-5
        table = torch.cat([out["rotated"][i], out["own"][i][-1:]])  # the last token: not predicted from
        expected = forced_log_probs(hf, tokens, n, table)
        got = torch.tensor(out["r3_rotated"][i])
        assert (got - expected).abs().max() < 1e-5, i
        assert (got - torch.tensor(out["plain"][i])).abs().max() > 1e-3, i  # another routing, seen
        # fp64 routing: the same experts (the bias and groups honoured), log-probs within 1e-5
        assert (torch.tensor(out["fp64"][i]) - torch.tensor(out["plain"][i])).abs().max() < 1e-5, i
    # R2: the log-prob pass recorded the experts Hugging Face routes to; the steps replay them
    n_mbs = sum(len(step) for step in out["plans"])
    recorded = [s for s in out["seen"] if s[1] is not None][-n_mbs:]  # the training's log-prob pass
    replayed = out["seen"][-n_mbs:]  # the training steps
    micro_batches = [mb for step in out["plans"] for mb in step]
    for (_, record), (table, _), positions, starts in zip(recorded, replayed, micro_batches, out["starts"]):
        for p, start in zip(positions, starts):
            rows = slice(start, start + len(batch.tokens[p]) - 1)
            for li, experts in record.items():
                want = out["own"][p][:, li].long().sort(-1).values
                assert torch.equal(experts[rows].sort(-1).values, want), (p, li)
                assert torch.equal(table[rows, li].sort(-1).values, want), (p, li)
    assert out["fp64_dtype"] == torch.float64  # (the float32 router would pass the bound above too)
    assert out["r2_steps"][0]["kl_loss"] == 0.0 and out["r2_steps"][0]["moe_aux_loss"] > 0


@pytest.mark.parametrize("arch", [*DEFAULT, *(pytest.param(a, marks=pytest.mark.slow) for a in SLOW)])
def test_routing_replay_and_the_fp64_router_follow_the_familys_routing(family_models, arch):
    """R3 replaying the model's own routing is the model, bit for bit; replaying another one gives
    Hugging Face's forward forced to those experts within 1e-5; R2 records and replays the experts
    Hugging Face routes to (step-0 KL exactly 0); the float64 router chooses as the model does."""
    path = family_models[arch]
    _check(path, run_ranks(1, _rank, path)[0])
