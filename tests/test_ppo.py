"""PPO on the actor's side (--advantage-estimator ppo): GAE over given critic values, the returns
handed back for the critic, N ranks like one, and the critic-only steps that leave the weights."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import base_config, full_params, make_batch

GAMMA, LAMBD = 0.9, 0.8


def critic_values(batch) -> dict[int, list[float]]:
    """Values a critic might give: a different ramp per sample."""
    return {
        i: (0.05 * i + 0.01 * torch.arange(n, dtype=torch.float32)).tolist()
        for i, n in enumerate(batch.response_lengths)
    }


def ppo_run(rank, world_size, init_method, model, update=True, estimator="ppo", dump=None):
    from slime.algo.objective import LossConfig
    from slime.backends.fsdp.actor import FSDPTrainActor

    cfg = base_config(model, micro_batch_size=2)
    cfg = dataclasses.replace(
        cfg,
        loss=dataclasses.replace(
            cfg.loss, advantage_estimator=estimator, gamma=GAMMA, lambd=LAMBD, kl_coef=0.05, use_kl_loss=False
        ),
        save_debug_train_data=dump,
    )
    assert isinstance(cfg.loss, LossConfig)
    actor = FSDPTrainActor(cfg, rank, world_size, init_method)
    actor.init()
    before = full_params(actor)
    batch = make_batch(0)
    result = {"output": actor.train(0, batch, values=critic_values(batch), update=update)}
    result["moved"] = max(float((p - before[n]).abs().max()) for n, p in full_params(actor).items())
    errors = []
    for values in (None, {**critic_values(batch), 3: [0.0]}):
        try:
            actor.train(1, batch, values=values)
        except Exception as e:
            errors.append(str(e))
    result["errors"] = errors
    actor.close()
    return result


@pytest.fixture(scope="module")
def one_rank(tiny_model):
    return run_ranks(1, ppo_run, tiny_model)[0]


def test_returns_are_gae_over_the_critics_values(one_rank):
    """At step 0 the actor is its reference, so --kl-coef's shaping is exactly 0 and each return
    is GAE of the reward on the last token over the given values."""
    from slime.algo.advantages import gae

    batch = make_batch(0)
    values = critic_values(batch)
    returns = one_rank["output"].returns
    assert sorted(returns) == list(range(len(batch)))
    for i, reward in enumerate(batch.rewards):
        rewards = torch.zeros(batch.response_lengths[i])
        rewards[-1] = reward
        _, expected = gae(rewards, torch.tensor(values[i]), GAMMA, LAMBD)
        torch.testing.assert_close(torch.tensor(returns[i]), expected, rtol=0, atol=1e-6)
    assert one_rank["moved"] > 0 and len(one_rank["output"].steps) == 2


def test_two_ranks_train_ppo_like_one(one_rank, tiny_model):
    ranks = run_ranks(2, ppo_run, tiny_model)
    assert {**ranks[0]["output"].returns, **ranks[1]["output"].returns}.keys() == one_rank[
        "output"
    ].returns.keys()
    for result in ranks:
        for index, values in result["output"].returns.items():
            assert values == pytest.approx(one_rank["output"].returns[index], abs=1e-6)
        for a, b in zip(one_rank["output"].steps, result["output"].steps, strict=True):
            bad = {k: (a[k], b[k]) for k in a if a[k] != pytest.approx(b[k], rel=2e-5, abs=2e-6)}
            assert not bad


def test_critic_only_steps_leave_the_weights_and_still_give_returns(one_rank, tiny_model, tmp_path):
    """Also: --save-debug-train-data records the critic's values and the returns (slime's fields)."""
    dump = str(tmp_path / "train_{rollout_id}_{rank}.pt")
    result = run_ranks(1, ppo_run, tiny_model, False, "ppo", dump)[0]
    assert result["moved"] == 0.0 and result["output"].steps == []
    assert result["output"].returns == one_rank["output"].returns
    rows = {
        r["sample_index"]: r for r in torch.load(tmp_path / "train_0_0.pt", weights_only=False)["samples"]
    }
    values = critic_values(make_batch(0))
    for index, row in rows.items():
        assert row["values"] == values[index]
        assert row["returns"] == pytest.approx(one_rank["output"].returns[index], abs=1e-6)


def test_values_are_required_with_ppo_and_refused_with_grpo(one_rank, tiny_model):
    assert one_rank["errors"][0] == "--advantage-estimator ppo trains with the critic's values"
    assert one_rank["errors"][1].startswith("sample 3: the critic's values do not cover its")
    with pytest.raises(Exception, match="critic values given with --advantage-estimator grpo"):
        run_ranks(1, ppo_run, tiny_model, True, "grpo")


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--advantage-estimator", "ppo", "--loss-type", "sft_loss"],
            "--advantage-estimator ppo trains a policy: --loss-type sft_loss has no advantages",
        ),
        (["--critic-lr", "1e-5"], "--critic-lr sets the critic, which only --advantage-estimator ppo has"),
        (
            [
                "--advantage-estimator",
                "ppo",
                "--actor-num-gpus-per-node",
                "2",
                "--critic-num-gpus-per-node",
                "1",
            ],
            "so it needs as many ranks as the actor (2)",
        ),
    ],
    ids=["sft-loss", "critic-flag-without-ppo", "critic-ranks"],
)
def test_critic_settings_that_cannot_run_are_refused_at_start_up(
    tiny_model, tmp_path, capsys, flags, message
):
    from slime.ray.cli import parse_args

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    with pytest.raises(SystemExit) as e:
        parse_args(
            [
                "--hf-checkpoint",
                tiny_model,
                "--prompt-data",
                str(prompts),
                "--rollout-batch-size",
                "2",
                "--num-rollout",
                "1",
                "--rm-type",
                "math",
                *flags,
            ]
        )
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert message in captured.err + captured.out


def test_the_critic_config_follows_the_actor(tiny_model, tmp_path):
    from slime.ray.cli import parse_args

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    config = parse_args(
        [
            "--hf-checkpoint",
            tiny_model,
            "--prompt-data",
            str(prompts),
            "--rollout-batch-size",
            "2",
            "--num-rollout",
            "1",
            "--rm-type",
            "math",
            "--advantage-estimator",
            "ppo",
            "--lr",
            "1e-5",
            "--critic-lr",
            "3e-5",
            "--use-kl-loss",
            "--kl-loss-coef",
            "0.1",
            "--kl-coef",
            "0.05",
            "--save",
            str(tmp_path / "s"),
            "--load",
            str(tmp_path / "s"),
            "--value-clip",
            "0.3",
            "--lambd",
            "0.95",
            "--lr-warmup-iters",
            "10",
        ]
    )
    critic = config.critic
    assert critic is not None and critic.num_ranks == 1 and critic.save == str(tmp_path / "s" / "critic")
    assert critic.train.optimizer.lr == 3e-5 and config.train.optimizer.lr == 1e-5
    # slime's --critic-lr-warmup-iters (0 unless given), not the actor's warm-up
    assert critic.train.optimizer.lr_warmup_iters == 0 and config.train.optimizer.lr_warmup_iters == 10
    assert critic.train.load == str(tmp_path / "s" / "critic") and critic.train.hf_checkpoint == tiny_model
    assert not critic.train.loss.needs_ref and config.train.loss.needs_ref
    assert (config.train.loss.value_clip, config.train.loss.lambd) == (0.3, 0.95)
    assert (
        parse_args(
            [
                "--hf-checkpoint",
                tiny_model,
                "--prompt-data",
                str(prompts),
                "--rollout-batch-size",
                "2",
                "--num-rollout",
                "1",
                "--rm-type",
                "math",
            ]
        ).critic
        is None
    )


def test_the_critic_leaves_out_the_actors_reference_and_old_actor_flags(tiny_model, tmp_path):
    """--ref-update-interval and --keep-old-actor are the policy's: the critic (no log-probs) keeps no
    reference and no pushed versions, and its rank does not keep the old actor's copies."""
    from slime.ray.actors import TrainRank
    from slime.ray.cli import parse_args

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = ["--hf-checkpoint", tiny_model, "--prompt-data", str(prompts), "--rollout-batch-size", "2"]
    base += ["--num-rollout", "1", "--rm-type", "math", "--advantage-estimator", "ppo"]
    config = parse_args([*base, "--kl-coef", "0.05", "--ref-update-interval", "2", "--keep-old-actor"])
    assert config.train.loss.ref_update_interval == 2 and config.train.loss.keep_old_actor
    assert config.critic is not None
    loss = config.critic.train.loss
    assert loss.ref_update_interval is None and not loss.keep_old_actor and not loss.needs_ref
    rank = TrainRank.__new__(TrainRank)  # what init() asks, without building a model
    rank.actor, rank.critic = types.SimpleNamespace(cfg=config.train), True
    assert not rank._keeps_old_actor()
    rank.critic = False
    assert rank._keeps_old_actor()


def test_a_bad_critic_load_is_named_before_the_job_starts(tiny_model, tmp_path):
    """--critic-load is read before Ray starts, and a bad one is named as itself (not as
    --hf-checkpoint, the name the critic ranks give their starting checkpoint)."""
    from slime.ray.cli import parse_args
    from slime.ray.inputs import input_problems

    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = [
        "--hf-checkpoint",
        tiny_model,
        "--prompt-data",
        str(prompts),
        "--rollout-batch-size",
        "2",
        "--num-rollout",
        "1",
        "--rm-type",
        "math",
        "--advantage-estimator",
        "ppo",
    ]
    problems = input_problems(parse_args([*base, "--critic-load", str(tmp_path / "nowhere")]), reach=False)
    assert problems == [f"--critic-load {str(tmp_path / 'nowhere')!r} is not a directory"]
    assert input_problems(parse_args([*base, "--critic-load", tiny_model]), reach=False) == []
