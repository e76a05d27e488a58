"""FSDP actor options on one rank (one spawned process builds several actors), and bad input."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil

import pytest
import torch

from slime.algo import advantages as adv
from slime.algo.objective import LossConfig
from slime.backends.fsdp.actor import FSDPTrainActor
from slime.backends.hf_checkpoint import CheckpointError
from slime.config.train import BatchConfig, FSDPConfig, ModelOptions, OptimizerConfig, TrainConfig
from slime.utils.rollout_batch import BatchError, RolloutBatch
from tests.dist_helpers import run_ranks
from tests.test_fsdp_actor import make_batch


def _actor(cfg, rank, world_size, init_method):
    actor = FSDPTrainActor(cfg, rank, world_size, init_method)
    actor.init()
    return actor


def _count_layer_calls(actor) -> list[int]:
    """Counts forwards of the first layer's attention (recomputation runs it again in backward;
    Hugging Face checkpoints the layer's `forward`, so the layer's own hooks do not see it)."""
    calls = [0]
    layer = actor.backend.model.model.layers[0].self_attn
    layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def run_options(rank, world_size, init_method, model, save_dir):
    out = {}
    base = TrainConfig(
        hf_checkpoint=model,
        loss=LossConfig(use_kl_loss=True, kl_loss_coef=0.1),
        optimizer=OptimizerConfig(lr=1e-4),
        batch=BatchConfig(global_batch_size=4, micro_batch_size=2),
    )
    batch = make_batch(7)
    plain = _actor(base, rank, world_size, init_method)
    out["plain_calls"] = _count_layer_calls(plain)
    out["plain"] = plain.train(0, batch).steps
    plain.save(0, save_dir)

    ckpt = _actor(
        dataclasses.replace(base, fsdp=FSDPConfig(gradient_checkpointing=True)), rank, world_size, init_method
    )
    out["checkpointed_calls"] = _count_layer_calls(ckpt)
    out["checkpointed"] = ckpt.train(0, batch).steps
    out["plain_calls"], out["checkpointed_calls"] = out["plain_calls"][0], out["checkpointed_calls"][0]

    bf16 = _actor(
        dataclasses.replace(base, fsdp=FSDPConfig(param_dtype="bfloat16")), rank, world_size, init_method
    )
    out["bf16_lp"] = bf16.compute_log_probs(batch)
    out["fp32_lp"] = _actor(base, rank, world_size, init_method).compute_log_probs(batch)

    # A smaller log-prob budget: more micro-batches in the log-prob pass, same values.
    dyn = BatchConfig(
        num_steps_per_rollout=2,
        use_dynamic_batch_size=True,
        max_tokens_per_gpu=64,
        log_probs_max_tokens_per_gpu=16,
    )
    small = _actor(dataclasses.replace(base, batch=dyn), rank, world_size, init_method)
    out["small_budget_lp"] = small.compute_log_probs(batch)
    plans = small.log_prob_plans(batch, small.plan(batch))
    out["small_budget_mbs"] = [mb for step in plans for mb in step.micro_batches]
    out["train_budget_mbs"] = [mb for step in small.plan(batch) for mb in step.micro_batches]

    sft = _actor(
        dataclasses.replace(base, loss=LossConfig(loss_type="sft_loss")), rank, world_size, init_method
    )
    out["sft"] = sft.train(0, batch).steps

    unsharded = _actor(
        dataclasses.replace(base, fsdp=FSDPConfig(disable_sharding=True)), rank, world_size, init_method
    )
    out["unsharded_param_types"] = {type(p).__name__ for p in unsharded.backend.model.parameters()}
    out["sharded_param_types"] = {type(p).__name__ for p in plain.backend.model.parameters()}
    out["unsharded_lp"] = unsharded.compute_log_probs(batch)
    out["unsharded"] = unsharded.train(0, batch).steps
    out["unsharded_export"] = [n for b in unsharded.export_weights(1 << 20) for n, _ in b]
    out["sharded_export"] = [n for b in plain.export_weights(1 << 20) for n, _ in b]

    plain_again = _actor(base, rank, world_size, init_method).train(0, batch)
    out["plain_rollout"], out["plain_step"] = plain_again.rollout, plain_again.steps[0]
    engine_old = _actor(
        dataclasses.replace(
            base, loss=LossConfig(use_kl_loss=True, kl_loss_coef=0.1, use_rollout_logprobs=True)
        ),
        rank,
        world_size,
        init_method,
    ).train(0, batch)
    out["engine_old_rollout"], out["engine_old_step"] = engine_old.rollout, engine_old.steps[0]
    sft_only = dataclasses.replace(
        base, loss=LossConfig(loss_type="sft_loss", compute_advantages_and_returns=False)
    )
    no_adv = _actor(sft_only, rank, world_size, init_method).train(0, batch)
    out["sft_no_adv_rollout"], out["sft_no_adv"] = no_adv.rollout, no_adv.steps
    sgd = _actor(
        dataclasses.replace(base, optimizer=OptimizerConfig(lr=1e-2, optimizer="sgd", sgd_momentum=0.5)),
        rank,
        world_size,
        init_method,
    )
    before = {k: v.clone() for k, v in sgd.backend.snapshot().items()}
    sgd.train(0, batch)
    out["sgd_type"] = type(sgd.backend.optimizer).__name__
    reset = _actor(
        dataclasses.replace(base, optimizer=OptimizerConfig(lr=1e-4, reset_optimizer_states=True)),
        rank,
        world_size,
        init_method,
    )
    plain_1 = plain.train(1, batch)
    out["plain_kl_1"], out["plain_rollout_1"] = plain_1.steps[0]["kl_loss"], plain_1.rollout
    reset.train(1, batch)
    # --ref-update-interval and --use-rollout-entropy, in one actor
    every = dataclasses.replace(
        base, loss=dataclasses.replace(base.loss, ref_update_interval=1, use_rollout_entropy=True)
    )
    refreshed = _actor(every, rank, world_size, init_method)
    out["entropy_rollout"] = refreshed.train(0, batch).rollout
    out["refreshed_kl_1"] = refreshed.train(1, batch).steps[0]["kl_loss"]
    out["entropy_step0"] = out["plain"][0]["entropy"]
    out["adam_steps"] = [int(next(iter(a.backend.optimizer.state.values()))["step"]) for a in (plain, reset)]
    out["steps_per_rollout"] = len(reset.train(2, batch).steps)
    stateless = _actor(
        dataclasses.replace(base, optimizer=OptimizerConfig(lr=1e-4, use_stateless_adam=True)),
        rank,
        world_size,
        init_method,
    )
    stateless.train(0, batch)
    out["stateless_state"] = len(stateless.backend.optimizer.state)
    for key, opt in (
        ("only", OptimizerConfig(lr=1e-3, only_train_params_name_list=[r"layers\.0\.mlp"])),
        ("frozen", OptimizerConfig(lr=1e-3, freeze_params_name_list=["embed_tokens", "norm"])),
    ):
        actor = _actor(dataclasses.replace(base, optimizer=opt), rank, world_size, init_method)
        before = {k: v.clone() for k, v in actor.backend.snapshot().items()}
        actor.train(0, batch)
        out[key] = sorted(k for k, v in actor.backend.snapshot().items() if not torch.equal(before[k], v))
        out[key + "_all"] = sorted(before)
    keeper = _actor(
        dataclasses.replace(base, loss=dataclasses.replace(base.loss, keep_old_actor=True)),
        rank,
        world_size,
        init_method,
    )
    keeper.keep_weights("v0")
    v0 = dataclasses.replace(batch, weight_versions=["v0"] * len(batch))
    out["keep"] = [keeper.train(r, v0) for r in range(2)]  # rollout 1 was generated by v0 too (one step off)
    try:
        keeper.train(2, dataclasses.replace(batch, weight_versions=["v7"] * len(batch)))
    except BatchError as e:
        out["keep_error"] = str(e)
    for key, flops in (("tokens", False), ("flops", True)):
        dynamic = BatchConfig(
            global_batch_size=4, use_dynamic_batch_size=True, max_tokens_per_gpu=24, balance_by_flops=flops
        )
        out[f"dynamic_{key}"] = (
            _actor(dataclasses.replace(base, batch=dynamic), rank, world_size, init_method)
            .train(0, batch)
            .steps
        )
    typo = OptimizerConfig(freeze_params_name_list=["embed_tokens", "no_such_layer"])
    try:
        _actor(dataclasses.replace(base, optimizer=typo), rank, world_size, init_method)
    except ValueError as e:
        out["typo_error"] = str(e)
    out["sgd_changed"] = any(not torch.equal(before[k], v) for k, v in sgd.backend.snapshot().items())
    drop = _actor(
        dataclasses.replace(base, model=ModelOptions(attention_dropout=0.5)), rank, world_size, init_method
    )
    out["dropout_lp"] = drop.compute_log_probs(batch)  # no dropout in log-prob passes
    out["dropout_step"] = drop.train(0, batch).steps[0]  # dropout in the training step

    rpp = LossConfig(advantage_estimator="reinforce_plus_plus", kl_coef=0.05, gamma=0.9)
    out["rpp"] = (
        _actor(dataclasses.replace(base, loss=rpp), rank, world_size, init_method).train(0, batch).steps
    )

    tis = _actor(dataclasses.replace(base, loss=LossConfig(use_tis=True)), rank, world_size, init_method)
    out["tis_builtin"] = _actor(tis.cfg, rank, world_size, init_method).train(0, batch).steps
    hooked = dataclasses.replace(
        tis.cfg,
        loss=LossConfig(
            use_tis=True,
            custom_tis_function_path="tests.fixtures.loss_hooks.clamp_tis",
            custom_pg_loss_reducer_function_path="tests.fixtures.loss_hooks.sample_mean_reducer",
        ),
        plugin_args=argparse.Namespace(tis_clip=2.0, tis_clip_low=0.0),
    )
    out["tis_hooked"] = _actor(hooked, rank, world_size, init_method).train(0, batch).steps
    # Rewards a post-process hook gave (here: the group mean removed) are trained on as they are, and
    # so are raw rewards with --disable-rewards-normalization: both train as GRPO without the std.
    mean_only = dataclasses.replace(
        base, loss=dataclasses.replace(base.loss, disable_grpo_std_normalization=True)
    )
    out["mean_only"] = _actor(mean_only, rank, world_size, init_method).train(0, batch).steps
    centered = adv.normalize_group_rewards(batch.rewards, batch.group_indices, "reinforce_plus_plus_baseline")
    post = dataclasses.replace(batch, rewards=centered.tolist(), rewards_normalized=True)
    out["post_processed"] = _actor(base, rank, world_size, init_method).train(0, post).steps
    raw = dataclasses.replace(base, loss=dataclasses.replace(base.loss, rewards_normalization=False))
    out["unnormalised"] = (
        _actor(raw, rank, world_size, init_method)
        .train(0, dataclasses.replace(post, rewards_normalized=False))
        .steps
    )
    try:
        tis.train(0, dataclasses.replace(batch, rollout_log_probs=None))
    except BatchError as e:
        out["tis_error"] = str(e)
    corrections = LossConfig(
        use_opsm=True, opsm_delta=0.0, use_decoupled_loss=True, behav_imp_weight_cap=1.02
    )
    corrected = _actor(dataclasses.replace(base, loss=corrections), rank, world_size, init_method)
    out["corrected"] = corrected.train(0, batch).steps
    every_negative = dataclasses.replace(base, loss=dataclasses.replace(corrections, opsm_delta=-1.0))
    out["opsm_every_negative"] = _actor(every_negative, rank, world_size, init_method).train(0, batch).steps
    try:
        corrected.train(1, dataclasses.replace(batch, rollout_log_probs=None))
    except BatchError as e:
        out["decoupled_error"] = str(e)

    changed_lr = dataclasses.replace(base, optimizer=OptimizerConfig(lr=5e-4), load=save_dir)
    try:
        _actor(changed_lr, rank, world_size, init_method)
    except ValueError as e:
        out["lr_error"] = str(e)
    overridden = _actor(
        dataclasses.replace(changed_lr, override_opt_param_scheduler=True), rank, world_size, init_method
    )
    out["overridden_lr"] = overridden.train(1, batch).steps[0]["lr"]

    odd = dataclasses.replace(base, batch=BatchConfig(global_batch_size=3, micro_batch_size=2))
    try:
        _actor(odd, rank, world_size, init_method)
    except ValueError as e:
        out["layout_error"] = str(e)
    plain.close()
    return out


@pytest.fixture(scope="module")
def options(tiny_model, tmp_path_factory):
    return run_ranks(1, run_options, tiny_model, str(tmp_path_factory.mktemp("opt") / "ckpt"))[0]


def test_gradient_checkpointing_recomputes_and_changes_nothing(options):
    # 4 micro-batches (2 steps x 2): log-prob pass for actor and reference, then training,
    # whose backward recomputes each layer forward when checkpointing is on.
    assert options["plain_calls"] == 4 * 2 + 4
    assert options["checkpointed_calls"] == 4 * 2 + 4 + 4
    for a, b in zip(options["plain"], options["checkpointed"]):
        assert a == pytest.approx(b, rel=1e-6, abs=1e-9)


def test_disable_sharding_trains_the_plain_module_like_fsdp(options):
    assert options["unsharded_param_types"] == {"Parameter"}
    assert options["sharded_param_types"] == {"DTensor"}
    for k, values in options["fp32_lp"].items():
        assert values == pytest.approx(options["unsharded_lp"][k], abs=1e-6)
    for a, b in zip(options["plain"], options["unsharded"]):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-8)
    assert options["unsharded_export"] == options["sharded_export"]


def test_disable_sharding_refuses_what_it_cannot_do(tiny_model, tmp_path, capsys):
    from slime.ray.cli import parse_args

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = [
        "--hf-checkpoint",
        tiny_model,
        "--prompt-data",
        str(data),
        "--rollout-batch-size",
        "1",
        "--num-rollout",
        "1",
        "--rm-type",
        "exact",
        "--debug-disable-sharding",
    ]
    assert parse_args(base).train.fsdp.disable_sharding
    for extra, message in [
        (["--actor-num-gpus-per-node", "2"], "--debug-disable-sharding runs one unsharded train rank"),
        (["--fsdp-param-dtype", "bfloat16"], "drop --fsdp-param-dtype"),
    ]:
        with pytest.raises(SystemExit) as e:
            parse_args([*base, *extra])
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_bf16_compute_is_close_to_fp32(options):
    diffs = [
        abs(a - b) for k in options["fp32_lp"] for a, b in zip(options["fp32_lp"][k], options["bf16_lp"][k])
    ]
    assert 0 < max(diffs) < 0.1


def test_log_prob_budget_splits_the_pass_without_changing_values(options):
    lengths = [len(t) for t in make_batch(7).tokens]
    assert len(options["small_budget_mbs"]) > len(options["train_budget_mbs"])
    for mb in options["small_budget_mbs"]:
        assert len(mb) == 1 or max(lengths[i] for i in mb) * len(mb) <= 16
    for k, values in options["fp32_lp"].items():
        assert values == pytest.approx(options["small_budget_lp"][k], abs=1e-5)


def test_sft_loss_is_the_mean_nll(options, hf_model):
    batch = make_batch(7)
    per_sample = []
    for tokens, r, mask in zip(batch.tokens, batch.response_lengths, batch.loss_masks):
        with torch.no_grad():
            logits = hf_model(torch.tensor([tokens])).logits[0].float()
        lp = torch.log_softmax(logits[len(tokens) - r - 1 : len(tokens) - 1], -1)
        nll = -lp.gather(-1, torch.tensor(tokens[-r:])[:, None]).squeeze(-1)
        m = torch.tensor(mask, dtype=torch.float32)
        per_sample.append(float((nll * m).sum() / m.sum()))
    expected = sum(per_sample[:4]) / 4  # the first optimizer step holds samples 0-3
    assert options["sft"][0]["loss"] == pytest.approx(expected, rel=1e-5)
    assert set(options["sft"][0]) == {"loss", "grad_norm", "lr"}


def test_reinforce_plus_plus_trains_with_kl_rewards(options):
    steps = options["rpp"]
    assert len(steps) == 2 and all(torch.isfinite(torch.tensor(s["loss"])) for s in steps)
    assert steps[0]["grad_norm"] > 0


def test_rollout_logprobs_are_the_old_policy_with_the_flag(options):
    plain, engine = options["plain_rollout"], options["engine_old_rollout"]
    assert plain["train_rollout_logprob_abs_diff"] > 1e-3  # make_batch perturbs the engine's log-probs
    assert engine["log_probs"] == engine["rollout_log_probs"] == plain["rollout_log_probs"]
    assert engine["train_rollout_logprob_abs_diff"] == 0.0
    # The ratio is now current / engine, not current / recomputed (1 at the first step).
    assert options["plain_step"]["ppo_kl"] == 0.0 and options["engine_old_step"]["ppo_kl"] != 0.0


def test_sft_without_log_prob_passes_trains_the_same_objective(options):
    assert options["sft_no_adv_rollout"] == {}  # no log-prob pass: no rollout log-prob metrics
    assert [s["loss"] for s in options["sft_no_adv"]] == [s["loss"] for s in options["sft"]]


def test_loss_and_reward_hooks_train_as_the_builtins_they_restate(options):
    for hooked, builtin in zip(options["tis_hooked"], options["tis_builtin"], strict=True):
        for name in ("loss", "pg_loss", "tis", "tis_abs", "tis_clipfrac", "grad_norm"):
            assert hooked[name] == pytest.approx(builtin[name], rel=1e-5, abs=1e-7), name
    assert options["tis_builtin"][0]["tis_clipfrac"] > 0  # make_batch's engine log-probs are far off
    for name in ("post_processed", "unnormalised"):
        assert options[name] == options["mean_only"], name
    assert options["mean_only"][0]["loss"] != options["plain"][0]["loss"]  # the std division matters here


def test_off_policy_corrections_train_through_the_actor(options):
    first, second = options["corrected"]
    # At the first step the policy is the recomputed one exactly (mean log-ratio 0, not above delta 0);
    # delta -1 masks every sample with a negative advantage: 1 of the first step's 4 (rewards 1, 0, 1, 1).
    assert first["opsm_clipfrac"] == 0.0
    assert options["opsm_every_negative"][0]["opsm_clipfrac"] == pytest.approx(0.25)
    assert options["opsm_every_negative"][0]["pg_loss"] != first["pg_loss"]
    for step in (first, second):
        assert 0 < step["behav_mask_frac"] < 1 and 0 < step["behav_imp_weight"] < 1.02
        assert math.isfinite(step["loss"])
    assert first["grad_norm"] > 0
    assert "--use-decoupled-loss" in options["decoupled_error"]


def test_sgd_optimizer_steps(options):
    assert options["sgd_type"] == "SGD" and options["sgd_changed"]


def test_optimizer_states_reset_before_each_rollout_and_stateless_adam_keeps_none(options):
    plain, reset = options["adam_steps"]  # after rollouts 0 and 1 (plain) against rollout 1 alone (reset)
    assert reset == options["steps_per_rollout"] and plain == 2 * reset
    assert options["stateless_state"] == 0


def test_ref_update_interval_makes_the_trained_weights_the_reference(options):
    # rollout 1's first step: the reference is rollout 0's result, the weights being trained
    assert options["refreshed_kl_1"] == 0.0 and options["plain_kl_1"] != 0.0


def test_micro_batches_balanced_by_flops_train_the_same_steps(options):
    for a, b in zip(options["dynamic_tokens"], options["dynamic_flops"], strict=True):
        assert math.isclose(a["loss"], b["loss"], rel_tol=1e-5, abs_tol=1e-7)
        assert math.isclose(a["grad_norm"], b["grad_norm"], rel_tol=1e-4)


def test_rollout_entropy_is_measured_in_the_log_prob_passes(options):
    got = options["entropy_rollout"]
    # at step 0 the actor and the reference are the same weights; the log-prob pass's entropy is the
    # first training forward's, over the same tokens (train/entropy weighs samples, not tokens)
    assert got["entropy"] == got["ref_entropy"] > 0
    assert math.isclose(got["entropy"], options["entropy_step0"], rel_tol=0.05)
    assert "entropy" not in options["plain_rollout_1"]  # only when asked for


def test_keep_old_actor_takes_the_old_log_probs_with_the_generating_weights(options):
    first, second = options["keep"]
    # rollout 1 came from v0: its old log-probs are v0's (rollout 0's, the same batch), so the PPO
    # ratio starts away from 1; without the kept weights it would start at exactly 1
    assert second.rollout["log_probs"] == first.rollout["log_probs"]
    assert first.steps[0]["ppo_kl"] == 0.0 and second.steps[0]["ppo_kl"] != 0.0
    assert "weight version(s) ['v7']" in options["keep_error"] and "['v0']" in options["keep_error"]


def test_parameters_freeze_by_name_patterns(options):
    assert options["only"] and all(".layers.0.mlp." in k for k in options["only"])
    assert not any("embed_tokens" in k or "norm" in k for k in options["frozen"])
    assert {k for k in options["frozen_all"] if "embed_tokens" not in k and "norm" not in k} <= set(
        options["frozen"]
    )
    assert "'no_such_layer' matches no parameter" in options["typo_error"]
    assert "--freeze-params-name-list" in options["typo_error"]


def test_attention_dropout_acts_in_training_steps_only(options):
    for p, values in options["fp32_lp"].items():
        assert values == options["dropout_lp"][p]
    assert options["dropout_step"]["loss"] != options["plain_step"]["loss"]


def test_bad_train_input_names_flags(options):
    assert "--use-tis" in options["tis_error"] and "rollout_log_probs" in options["tis_error"]
    assert "--override-opt-param-scheduler" in options["lr_error"]
    assert options["overridden_lr"] == 5e-4
    assert "--global-batch-size 3" in options["layout_error"]


# ---- start-up checks that need no process group -------------------------------------------------
def _init_error(path: str) -> str:
    with pytest.raises(CheckpointError) as err:
        FSDPTrainActor(TrainConfig(hf_checkpoint=path)).init()
    return str(err.value)


def test_missing_checkpoint_dir(tmp_path):
    assert "--hf-checkpoint" in _init_error(str(tmp_path / "nope")) and "not a directory" in _init_error(
        str(tmp_path / "nope")
    )
    assert "no config.json" in _init_error(str(tmp_path))


def test_not_a_causal_lm(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clip"}))
    assert "not a causal language model" in _init_error(str(tmp_path))


def test_vocab_disagrees_with_tokenizer(tiny_model, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model, bad)
    config = json.loads((bad / "config.json").read_text())
    config["vocab_size"] = 50
    (bad / "config.json").write_text(json.dumps(config))
    message = _init_error(str(bad))
    assert "101 tokens" in message and "vocab_size=50" in message


def test_checkpoint_without_weights(tiny_model, tmp_path):
    bad = tmp_path / "noweights"
    shutil.copytree(tiny_model, bad)
    os.remove(bad / "model.safetensors")
    assert "no *.safetensors" in _init_error(str(bad))


def test_batch_validation_names_fields():
    batch = RolloutBatch([[1, 2, 3]], [3], [1.0], [0])
    with pytest.raises(BatchError, match="response_length 3"):
        batch.validate(101)
    with pytest.raises(BatchError, match="'loss_masks' has 1 entries"):
        RolloutBatch([[1, 2, 3]], [2], [1.0], [0], loss_masks=[[1]]).validate(101)
    with pytest.raises(BatchError, match="outside the model's vocabulary"):
        RolloutBatch([[1, 2, 300]], [1], [1.0], [0]).validate(101)
