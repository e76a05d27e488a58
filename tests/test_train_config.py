"""Train flags -> TrainConfig, and the learning-rate schedule."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from slime.backends.optim import LRSchedule, lr_at
from slime.config.train import BatchConfig, OptimizerConfig, add_train_arguments, train_config_from_args


def parse(*argv: str):
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return train_config_from_args(parser.parse_args(list(argv)))


def test_flags_fill_typed_configs():
    cfg = parse(
        "--hf-checkpoint",
        "/m",
        "--lr",
        "3e-4",
        "--eps-clip",
        "0.1",
        "--eps-clip-high",
        "0.3",
        "--use-kl-loss",
        "--kl-loss-type",
        "low_var_kl",
        "--global-batch-size",
        "8",
        "--micro-batch-size",
        "2",
        "--fsdp-param-dtype",
        "bfloat16",
        "--gradient-checkpointing",
        "--use-tis",
        "--calculate-per-token-loss",
        "--advantage-estimator",
        "rloo",
    )
    assert cfg.hf_checkpoint == "/m"
    assert cfg.optimizer.lr == 3e-4
    assert cfg.loss.clip_high == 0.3 and cfg.loss.kl_loss_type == "low_var_kl" and cfg.loss.use_kl_loss
    assert cfg.loss.use_tis and cfg.loss.calculate_per_token_loss and cfg.loss.advantage_estimator == "rloo"
    assert cfg.batch.global_batch_size == 8 and cfg.batch.micro_batch_size == 2
    assert cfg.fsdp.param_dtype == "bfloat16" and cfg.fsdp.gradient_checkpointing
    assert cfg.loss.needs_ref and cfg.loss.needs_rollout_log_probs


@pytest.mark.parametrize(
    "argv, flag",
    [
        ([], "--hf-checkpoint"),
        (["--hf-checkpoint", "m", "--use-dynamic-batch-size"], "--max-tokens-per-gpu"),
        (["--hf-checkpoint", "m", "--lr-decay-style", "cosine"], "--lr-decay-iters"),
        (["--hf-checkpoint", "m", "--fsdp-cpu-offload"], "--fsdp-cpu-offload"),
        (["--hf-checkpoint", "m", "--eps-clip-c", "0.9"], "--eps-clip-c"),
        (["--hf-checkpoint", "m", "--micro-batch-size", "0"], "--micro-batch-size"),
        (["--hf-checkpoint", "m", "--peak-tflops", "0"], "--peak-tflops"),
    ],
)
def test_bad_combinations_name_the_flag(argv, flag):
    with pytest.raises(ValueError, match=flag):
        parse(*argv)


def test_peak_tflops_is_the_gpus_unless_given():
    assert parse("--hf-checkpoint", "/m").peak_tflops is None  # the GPU table's (slime.utils.flops)
    assert parse("--hf-checkpoint", "/m", "--peak-tflops", "989.5").peak_tflops == 989.5


def test_global_batch_must_split_over_micro_batches_and_ranks():
    BatchConfig(global_batch_size=8, micro_batch_size=2).check_layout(4)
    with pytest.raises(ValueError, match=r"--micro-batch-size × data-parallel ranks \(2 × 3\)"):
        BatchConfig(global_batch_size=8, micro_batch_size=2).check_layout(3)
    with pytest.raises(ValueError, match="data-parallel ranks"):
        BatchConfig(global_batch_size=5, use_dynamic_batch_size=True, max_tokens_per_gpu=64).check_layout(2)


def test_lr_schedules_by_hand():
    # Megatron-LM's schedule (slime's): warm-up from --lr-warmup-init at step 0, decay counted from step 0.
    warm = OptimizerConfig(lr=1.0, lr_warmup_iters=4)
    assert [lr_at(warm, s) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_at(OptimizerConfig(lr=1.0, lr_warmup_iters=4, lr_warmup_init=0.2), 0) == 0.2
    linear = OptimizerConfig(lr=1.0, min_lr=0.2, lr_decay_style="linear", lr_decay_iters=4)
    assert [round(lr_at(linear, s), 6) for s in (0, 2, 4, 9)] == [1.0, 0.6, 0.2, 0.2]
    cosine = OptimizerConfig(lr=1.0, min_lr=0.0, lr_warmup_iters=1, lr_decay_style="cosine", lr_decay_iters=4)
    assert [lr_at(cosine, s) for s in (0, 1)] == [0.0, 1.0]  # warm-up, then the peak
    assert lr_at(cosine, 3) == pytest.approx(0.5 * (1 + math.cos(math.pi * 2 / 3)))  # (3 - 1) / (4 - 1)
    assert lr_at(cosine, 4) == pytest.approx(0.0, abs=1e-12) and lr_at(cosine, 5) == 0.0
    with pytest.raises(ValueError, match=r"--lr-decay-iters \(4\) counts from the first step"):
        OptimizerConfig(lr_warmup_iters=4, lr_decay_style="linear", lr_decay_iters=4)


def test_schedule_refuses_a_changed_lr_on_resume_unless_overridden():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    saved = LRSchedule(opt, OptimizerConfig(lr=1e-3))
    saved.step()
    state = saved.state_dict()
    changed = LRSchedule(opt, OptimizerConfig(lr=2e-3))
    with pytest.raises(ValueError, match="--override-opt-param-scheduler") as err:
        changed.load_state_dict(state, override=False)
    assert "lr: saved 0.001 vs now 0.002" in str(err.value)
    changed.load_state_dict(state, override=True)
    assert changed.num_steps == 1 and opt.param_groups[0]["lr"] == 2e-3


def test_num_steps_per_rollout_sets_the_global_batch():
    assert BatchConfig(num_steps_per_rollout=4).global_batch_for(32) == 8
    assert BatchConfig(global_batch_size=8, num_steps_per_rollout=4).global_batch_for(32) == 8
    assert BatchConfig().global_batch_for(32) == 32
    with pytest.raises(ValueError, match="disagrees with --num-steps-per-rollout"):
        BatchConfig(global_batch_size=16, num_steps_per_rollout=4).global_batch_for(32)
    with pytest.raises(ValueError, match="--num-steps-per-rollout 3 does not divide"):
        BatchConfig(num_steps_per_rollout=3).global_batch_for(32)


def test_resume_refuses_changed_optimizer_settings_the_checkpoint_would_override():
    # A loaded optimizer state carries its param_groups' momentum / betas: a changed flag would be
    # silently ignored, so it is refused unless --override-opt-param-scheduler.
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    state = LRSchedule(opt, OptimizerConfig(optimizer="sgd", sgd_momentum=0.9)).state_dict()
    with pytest.raises(ValueError, match=r"sgd_momentum: saved 0\.9 vs now 0\.5"):
        LRSchedule(opt, OptimizerConfig(optimizer="sgd", sgd_momentum=0.5)).load_state_dict(
            state, override=False
        )
    with pytest.raises(ValueError, match=r"adam_beta2: saved 0\.999 vs now 0\.95"):
        LRSchedule(opt, OptimizerConfig(adam_beta2=0.95)).load_state_dict(
            LRSchedule(opt, OptimizerConfig()).state_dict(), override=False
        )


def test_resume_refuses_another_optimizer_and_an_older_schedule_rule():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))])
    adam = LRSchedule(opt, OptimizerConfig()).state_dict()
    with pytest.raises(ValueError, match="the checkpoint's optimizer is adam, --optimizer is sgd"):
        LRSchedule(opt, OptimizerConfig(optimizer="sgd")).load_state_dict(adam, override=True)
    old = {k: v for k, v in adam.items() if k != "rule"}  # written before Megatron-LM's schedule
    with pytest.raises(ValueError, match="previous learning-rate schedule"):
        LRSchedule(opt, OptimizerConfig()).load_state_dict(old, override=False)
    LRSchedule(opt, OptimizerConfig()).load_state_dict(old, override=True)
    with pytest.raises(ValueError, match=r"--lr-warmup-init \(0\.5\) must be in \[0, --lr \(0\.1\)\]"):
        OptimizerConfig(lr=0.1, lr_warmup_init=0.5)


def test_off_policy_correction_flags():
    loss = parse("--hf-checkpoint", "/m", "--use-opsm", "--opsm-delta", "0.01").loss
    assert loss.use_opsm and loss.opsm_delta == 0.01 and not loss.needs_rollout_log_probs
    assert parse("--hf-checkpoint", "/m").loss.opsm_delta == 1e-4  # slime's default
    loss = parse("--hf-checkpoint", "/m", "--use-decoupled-loss", "--behav-imp-weight-cap", "5").loss
    assert loss.use_decoupled_loss and loss.behav_imp_weight_cap == 5.0
    assert loss.needs_rollout_log_probs  # the batch must carry the engine's log-probs


@pytest.mark.parametrize(
    "extra, flags",
    [
        (
            ["--use-decoupled-loss", "--use-rollout-logprobs"],
            ["--use-decoupled-loss", "--use-rollout-logprobs"],
        ),
        (["--use-decoupled-loss", "--use-tis"], ["--use-decoupled-loss", "--use-tis"]),
        (
            ["--use-decoupled-loss", "--loss-type", "sft_loss", "--disable-compute-advantages-and-returns"],
            ["--use-decoupled-loss", "--loss-type sft_loss"],
        ),
        (
            ["--use-decoupled-loss", "--behav-imp-weight-cap", "0.9"],
            ["--behav-imp-weight-cap", "--use-decoupled-loss"],
        ),
        (["--behav-imp-weight-cap", "5"], ["--behav-imp-weight-cap", "--use-decoupled-loss"]),
    ],
)
def test_off_policy_corrections_refused_at_parse_time(tmp_path, capsys, extra, flags):
    from slime.ray.cli import parse_args

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    with pytest.raises(SystemExit) as e:
        parse_args(
            [
                "--hf-checkpoint",
                "/m",
                "--prompt-data",
                str(prompts),
                "--rollout-batch-size",
                "4",
                "--n-samples-per-prompt",
                "2",
                "--num-rollout",
                "3",
                "--rm-type",
                "exact",
                *extra,
            ]
        )
    err = capsys.readouterr().err
    assert e.value.code == 2 and all(f in err for f in flags), err


def test_stateless_adam_takes_a_fresh_adams_first_step_every_time():
    from slime.backends.optim import make_optimizer

    w = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    opt = make_optimizer(
        [w], OptimizerConfig(lr=0.1, weight_decay=0.5, adam_eps=1e-8, use_stateless_adam=True)
    )
    for grad in (torch.tensor([0.5, -4.0, 0.0]), torch.tensor([-2.0, 1.0, 3.0])):
        before = w.detach().clone()
        w.grad = grad
        opt.step()
        decayed = before * (1 - 0.1 * 0.5)
        torch.testing.assert_close(w.detach(), decayed - 0.1 * grad / (grad.abs() + 1e-8))
        assert not opt.state  # nothing kept between steps
    with pytest.raises(ValueError, match="--use-stateless-adam"):
        OptimizerConfig(optimizer="sgd", use_stateless_adam=True)


def test_adam_is_one_fused_kernel_where_every_parameter_is_on_a_gpu(monkeypatch):
    """torch's fused AdamW on CUDA (one kernel per step, DTensor shards included); on the CPU
    torch's default, so CPU runs compute exactly as before. (No GPU here: the parameters' device
    is what decides, so an AdamW that records its arguments stands in.)"""
    from types import SimpleNamespace

    from slime.backends.optim import make_optimizer

    made: list[dict] = []
    monkeypatch.setattr(torch.optim, "AdamW", lambda params, **kw: made.append(kw) or SimpleNamespace())
    cuda, cpu = SimpleNamespace(device=torch.device("cuda", 0)), SimpleNamespace(device=torch.device("cpu"))
    make_optimizer([cuda, cuda], OptimizerConfig(lr=0.1))
    make_optimizer([cuda, cpu], OptimizerConfig(lr=0.1))  # (--fsdp-cpu-offload keeps parameters on the CPU)
    make_optimizer([cpu], OptimizerConfig(lr=0.1))
    assert [kw.get("fused") for kw in made] == [True, None, None]
