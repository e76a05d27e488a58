"""The FSDP critic (slime.backends.fsdp.critic): a value model on the actor's transformer with a
fresh value head; its values against Hugging Face's forward, N ranks against one, and the value
loss going down when it fits returns."""

from __future__ import annotations

import re

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import base_config, make_batch


def fake_returns(batch, seed: int) -> dict[int, list[float]]:
    """Returns to fit: the reward plus a smooth per-token drift (what GAE makes of them is
    tested in tests/test_algo.py)."""
    g = torch.Generator().manual_seed(seed)
    return {
        i: (r + 0.1 * torch.randn(n, generator=g).cumsum(0)).tolist()
        for i, (r, n) in enumerate(zip(batch.rewards, batch.response_lengths))
    }


def critic_run(rank, world_size, init_method, model, rollouts=2, steps_per_batch=1):
    import dataclasses

    from slime.backends.fsdp.critic import FSDPCritic

    cfg = dataclasses.replace(base_config(model, micro_batch_size=2), check_precision=True)
    critic = FSDPCritic(cfg, rank, world_size, init_method)
    critic.init()
    result = {"values": critic.compute_values(make_batch(0)), "outputs": []}
    for r in range(rollouts):
        batch = make_batch(r)
        returns = fake_returns(batch, r)
        for _ in range(steps_per_batch):
            old = critic.compute_values(batch)
            everyone = [None] * world_size
            torch.distributed.all_gather_object(everyone, old)  # every rank's samples, as the job hands them
            old = {k: v for part in everyone for k, v in part.items()}
            result["outputs"].append(critic.train_values(r, batch, old, returns))
    result["after"] = critic.compute_values(make_batch(0))
    try:
        critic.train_values(9, make_batch(0), {}, fake_returns(make_batch(0), 0))
    except Exception as e:
        result["missing"] = str(e)
    critic.close()
    return result


@pytest.fixture(scope="module")
def one_rank(tiny_model):
    return run_ranks(1, critic_run, tiny_model)[0]


def test_fresh_values_are_hugging_faces_value_model(one_rank, tiny_model):
    """A token classifier with one output on the checkpoint, its head drawn as slime's value head
    (N(0, initializer_range), zero bias, from --seed): the value of response token t is its
    output at position t - 1."""
    from transformers import AutoModelForTokenClassification

    hf = AutoModelForTokenClassification.from_pretrained(tiny_model, num_labels=1, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(base_config(tiny_model).seed)
    with torch.no_grad():
        hf.score.weight.copy_(
            torch.randn(1, hf.config.hidden_size, generator=g) * hf.config.initializer_range
        )
        hf.score.bias.zero_()
    batch = make_batch(0)
    for i, (tokens, n) in enumerate(zip(batch.tokens, batch.response_lengths)):
        with torch.no_grad():
            out = hf(torch.tensor([tokens])).logits[0, :, 0]
        expected = out[len(tokens) - n - 1 : len(tokens) - 1]
        torch.testing.assert_close(torch.tensor(one_rank["values"][i]), expected, rtol=0, atol=1e-5)
    assert max(abs(v) for vs in one_rank["values"].values() for v in vs) > 1e-3  # the head is not zero


def test_the_first_steps_values_are_the_value_pass_bitwise(one_rank):
    """--check-precision: on the same weights and micro-batches the step's forward gives the value
    pass's values exactly (the critic's ppo_kl == 0); each rollout's first step is measured."""
    gaps = [o.precision["critic_first_step_max_abs_diff"] for o in one_rank["outputs"]]
    assert gaps == [0.0, 0.0]


def test_two_critic_ranks_train_like_one(one_rank, tiny_model):
    ranks = run_ranks(2, critic_run, tiny_model)
    for result in ranks:
        for a, b in zip(one_rank["outputs"], result["outputs"]):
            for sa, sb in zip(a.steps, b.steps, strict=True):
                assert sa.keys() == sb.keys() == {"value_loss", "value_clipfrac", "grad_norm", "lr"}
                for key in sa:
                    assert sa[key] == pytest.approx(sb[key], rel=2e-5, abs=1e-6), key
            for key, value in a.rollout.items():
                assert value == pytest.approx(b.rollout[key], rel=1e-5, abs=1e-6), key
        for index, values in result["after"].items():  # each rank: its share of the samples
            torch.testing.assert_close(
                torch.tensor(values), torch.tensor(one_rank["after"][index]), rtol=0, atol=2e-5
            )
    assert re.fullmatch(r"sample \d+: none values for its \d+ response tokens", ranks[0]["missing"])


@pytest.mark.slow  # ~6 s; the PPO demo (slow) shows the critic learning in a job
def test_the_value_loss_falls_as_the_critic_fits_the_returns(tiny_model):
    result = run_ranks(1, critic_run, tiny_model, 1, 6)[0]
    losses = [o.steps[0]["value_loss"] for o in result["outputs"]]
    assert losses[-1] < 0.5 * losses[0], losses
    first = result["outputs"][0].rollout
    assert set(first) == {"values", "returns", "explained_variance"}
    last_ev = result["outputs"][-1].rollout["explained_variance"]
    assert last_ev > first["explained_variance"], (first, last_ev)


def saved_critic(rank, world_size, init_method, model, save_dir, hf_dir, load=None):
    import dataclasses

    from slime.backends.fsdp.critic import FSDPCritic

    cfg = dataclasses.replace(base_config(model, micro_batch_size=2), load=load)
    critic = FSDPCritic(cfg, rank, world_size, init_method)
    info = critic.init()
    out = {"resumed": info["resumed_rollout_id"], "outputs": []}
    for r in range(info["resumed_rollout_id"] + 1 if load else 0, 2):
        batch = make_batch(r)
        old = critic.compute_values(batch)
        out["outputs"].append(critic.train_values(r, batch, old, fake_returns(batch, r)))
        if r == 0 and not load:
            critic.save(r, save_dir)
    out["after"] = critic.compute_values(make_batch(0))
    if not load:
        critic.save_hf(hf_dir)
    critic.close()
    return out


@pytest.mark.slow  # ~10 s: the FSDP actor's checkpoint code (tests/test_fsdp_actor.py resumes it)
def test_a_critic_checkpoint_resumes_bit_for_bit_and_exports_a_token_classifier(tiny_model, tmp_path):
    """--save / --load of the critic (model, optimizer, schedule), and its Hugging Face export:
    AutoModelForTokenClassification loads it and gives the critic's values."""
    from transformers import AutoModelForTokenClassification

    save_dir, hf_dir = str(tmp_path / "critic"), str(tmp_path / "critic_hf")
    first = run_ranks(2, saved_critic, tiny_model, save_dir, hf_dir)[0]
    again = run_ranks(2, saved_critic, tiny_model, save_dir, hf_dir, save_dir)[0]
    assert again["resumed"] == 0
    assert again["outputs"][0].steps == first["outputs"][1].steps
    assert again["after"] == first["after"]
    hf = AutoModelForTokenClassification.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert hf.config.num_labels == 1 and hf.config.architectures == ["Qwen3ForTokenClassification"]
    batch = make_batch(0)
    for i, values in first["after"].items():
        tokens, n = batch.tokens[i], batch.response_lengths[i]
        with torch.no_grad():
            out = hf(torch.tensor([tokens])).logits[0, len(tokens) - n - 1 : len(tokens) - 1, 0]
        torch.testing.assert_close(torch.tensor(values), out, rtol=0, atol=1e-5)
