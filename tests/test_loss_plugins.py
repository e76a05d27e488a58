"""slime's loss hooks (--custom-tis-function-path, --custom-pg-loss-reducer-function-path) and the
reward hooks (--custom-reward-post-process-path, --disable-rewards-normalization), on one
micro-batch in this process and through the flags."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest
import torch

from slime.algo import losses
from slime.algo.objective import MicroBatchTerms, micro_batch_loss
from slime.algo.plugins import LossHooks, Ragged
from slime.config.loss import LossConfig
from slime.rollout.summary import package_rollout, reward_post_process
from slime.utils.sample import Sample
from tests.fixtures import loss_hooks

HOOKS = "tests.fixtures.loss_hooks"
LENGTHS = [5, 3, 4]
PROMPTS = [2, 6, 3]
NUM_SAMPLES = 6  # the step's samples (this micro-batch holds 3 of them)


def _terms(
    per_token: bool = False, lengths: list[int] = LENGTHS, num_samples: int = NUM_SAMPLES
) -> MicroBatchTerms:
    g = torch.Generator().manual_seed(0)
    shape = (len(lengths), max(lengths))
    mask = torch.zeros(shape)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    mask[0, 2] = 0  # a token excluded from the loss
    old = -2 + 0.3 * torch.randn(shape, generator=g)
    tokens = int(mask.sum()) + 7  # the step's loss tokens
    return MicroBatchTerms(
        log_probs=(old + 0.1 * torch.randn(shape, generator=g)).requires_grad_(),
        mask=mask,
        weights=losses.token_weights(mask, per_token, num_samples, tokens),
        old_log_probs=old,
        advantages=torch.randn(len(lengths), 1, generator=g).expand(shape).clone(),
        rollout_log_probs=old + 0.4 * torch.randn(shape, generator=g),
        ragged=Ragged(list(lengths), [p + r for p, r in zip(PROMPTS, lengths)]),
        normaliser=float(tokens if per_token else num_samples),
    )


def _hooks(tis: str | None = None, reducer: str | None = None, **args) -> LossHooks:
    hooks = LossHooks.load(
        f"{HOOKS}.{tis}" if tis else None,
        f"{HOOKS}.{reducer}" if reducer else None,
        argparse.Namespace(**args),
    )
    assert hooks is not None
    return hooks


def _loss(cfg: LossConfig, t: MicroBatchTerms, hooks: LossHooks | None = None):
    loss, metrics = micro_batch_loss(cfg, t, hooks)
    (grad,) = torch.autograd.grad(loss, t.log_probs)
    return loss.detach(), metrics, grad


def test_a_tis_hook_equal_to_the_builtin_trains_the_same():
    cfg = LossConfig(use_tis=True, tis_clip=1.5, tis_clip_low=0.5)
    t = _terms()
    builtin = _loss(cfg, t)
    hooked = _loss(cfg, t, _hooks("clamp_tis", tis_clip=1.5, tis_clip_low=0.5))
    torch.testing.assert_close(hooked[0], builtin[0])
    torch.testing.assert_close(hooked[2], builtin[2])
    for name in ("tis", "tis_abs", "tis_clipfrac", "pg_loss", "ppo_kl"):
        torch.testing.assert_close(hooked[1][name], builtin[1][name])
    assert builtin[1]["tis_clipfrac"] > 0  # the clamp acted on some tokens


def test_a_tis_hook_shaped_like_slimes_example_runs_here():
    # slime's TIS example gathers over context-parallel ranks with slime.backends.megatron_utils.cp_utils.
    cfg = LossConfig(use_tis=True, tis_clip=1.5)
    t = _terms()
    builtin = _loss(cfg, t)
    hooked = _loss(cfg, t, _hooks("cp_gathering_tis", tis_clip=1.5))
    torch.testing.assert_close(hooked[0], builtin[0])


SLIME_LOSS = "slime.backends.megatron_utils.loss"


def _hooks_from_flags(*argv: str) -> tuple[LossConfig, LossHooks]:
    """The loss config and hooks a train rank builds from these train flags."""
    from slime.config.train import add_train_arguments, train_config_from_args

    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    cfg = train_config_from_args(parser.parse_args(["--hf-checkpoint", "/m", *argv]))
    hooks = LossHooks.load(cfg.loss.custom_tis_function_path, None, cfg.plugin_args)
    assert hooks is not None
    return cfg.loss, hooks


def test_icepop_at_slimes_path_by_hand():
    cfg, hooks = _hooks_from_flags(
        "--use-tis",
        "--custom-tis-function-path",
        f"{SLIME_LOSS}.icepop_function",
        "--tis-clip-low",
        "0.5",
        "--tis-clip",
        "2.0",
    )
    # Sample 0 (A = 1): r = exp(old - engine) = e (outside [0.5, 2]: 0), 1. Sample 1 (A = -1):
    # e^-1 (outside: 0), e^0.5, and e^-3 on a token outside the loss. The ratio new / old is 1, so
    # the clipped loss is -A per token; each sample's mean is over its 2 loss tokens, of 2 samples.
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    old = torch.zeros(2, 3)
    t = MicroBatchTerms(
        log_probs=old.clone().requires_grad_(),
        mask=mask,
        weights=losses.token_weights(mask, False, 2, 4),
        old_log_probs=old,
        advantages=torch.tensor([[1.0, 1.0, 0.0], [-1.0, -1.0, -1.0]]),
        rollout_log_probs=torch.tensor([[-1.0, 0.0, 0.0], [1.0, -0.5, 3.0]]),
        ragged=Ragged([2, 3], [5, 7]),
        normaliser=2.0,
    )
    loss, metrics, grad = _loss(cfg, t, hooks)
    e = torch.e
    torch.testing.assert_close(loss, torch.tensor(((0 - 1) + (0 + e**0.5)) / 4))
    torch.testing.assert_close(metrics["tis"], torch.tensor((e + 1 + e**-1 + e**0.5) / 4))
    torch.testing.assert_close(metrics["tis_abs"], torch.tensor((e - 1 + 0 + 1 - e**-1 + e**0.5 - 1) / 4))
    torch.testing.assert_close(metrics["tis_clipfrac"], torch.tensor(0.5))
    torch.testing.assert_close(metrics["ois"], torch.tensor(1.0))
    # the dropped tokens carry no gradient; the kept ones -A * w / 4
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.25, 0.0], [0.0, e**0.5 / 4, 0.0]]))


def test_vanilla_tis_at_slimes_path_is_the_builtin_exactly():
    cfg, hooks = _hooks_from_flags(
        "--use-tis",
        "--custom-tis-function-path",
        f"{SLIME_LOSS}.vanilla_tis_function",
        "--tis-clip-low",
        "0.5",
        "--tis-clip",
        "1.5",
    )
    # Layouts where rescaling the weights by each sample's normaliser would round differently
    # (11 loss tokens of 7 samples): a hook that rejects nothing leaves the weights as they are.
    for per_token, lengths, num_samples in (
        (False, LENGTHS, NUM_SAMPLES),
        (True, LENGTHS, NUM_SAMPLES),
        (False, [12, 9, 13], 7),
        (True, [12, 9, 13], 7),
    ):
        t = _terms(per_token, lengths, num_samples)
        builtin_cfg = LossConfig(
            use_tis=True, tis_clip=1.5, tis_clip_low=0.5, calculate_per_token_loss=per_token
        )
        builtin = _loss(builtin_cfg, t)
        hooked = _loss(dataclasses.replace(cfg, calculate_per_token_loss=per_token), t, hooks)
        assert torch.equal(hooked[0], builtin[0]) and torch.equal(hooked[2], builtin[2])
        assert hooked[1].keys() == builtin[1].keys()
        for name, value in builtin[1].items():
            assert torch.equal(hooked[1][name], value), name
        assert builtin[1]["tis_clipfrac"] > 0  # the clamp acted on some tokens


def test_slimes_loss_module_imports_without_megatron():
    code = (
        "import sys; import slime.backends.megatron_utils.loss as m; "
        "assert callable(m.icepop_function) and callable(m.vanilla_tis_function); "
        "assert not [n for n in sys.modules if n.split('.')[0] in ('megatron', 'transformer_engine')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_opsm_masks_the_loss_the_tis_hook_is_given():
    # As slime: the OPSM mask, then TIS; the hook multiplies the policy loss it is handed.
    t = _terms()
    t.log_probs = (t.old_log_probs - 0.5).requires_grad_()  # every sample drifted by 0.5 > delta
    cfg = LossConfig(use_tis=True, use_opsm=True)
    hooks = _hooks("clamp_tis", tis_clip=1e9, tis_clip_low=0.0)
    _, metrics, _ = _loss(cfg, t, hooks)
    _, builtin, _ = _loss(dataclasses.replace(cfg, tis_clip=1e9), t)
    _, unmasked, _ = _loss(dataclasses.replace(cfg, use_opsm=False), t, hooks)
    torch.testing.assert_close(metrics["pg_loss"], builtin["pg_loss"])
    assert not torch.allclose(metrics["pg_loss"], unmasked["pg_loss"])
    negative = (t.advantages[:, 0] < 0).float()  # the samples masked whole
    assert 0 < negative.sum() < len(LENGTHS)
    torch.testing.assert_close(metrics["opsm_clipfrac"], negative.sum() / NUM_SAMPLES)


def test_rejected_tokens_leave_the_loss_but_keep_their_samples_normaliser():
    t = _terms()
    loss, metrics, _ = _loss(LossConfig(use_tis=True), t, _hooks("reject_first_token"))
    pg, _ = losses.ppo_policy_loss(t.old_log_probs - t.log_probs.detach(), t.advantages, 0.2, 0.2)
    expected = sum(
        (pg[i, 1:n] * t.mask[i, 1:n]).sum() / (t.mask[i, :n].sum() * NUM_SAMPLES)
        for i, n in enumerate(LENGTHS)
    )
    torch.testing.assert_close(metrics["pg_loss"], expected)
    torch.testing.assert_close(loss, expected)
    # The hook's metrics are reduced over the masks it was given: the mean prompt length it saw.
    torch.testing.assert_close(metrics["prompt_len"], torch.tensor(sum(PROMPTS) / NUM_SAMPLES))


def test_rejected_tokens_leave_every_term_after_the_tis_hook():
    # slime rebuilds its reducer from the hook's masks: clipfrac, ppo_kl, entropy and the KL loss
    # drop the rejected tokens too; the hook's own metrics and ois keep the masks given.
    t = _terms()
    g = torch.Generator().manual_seed(1)
    t.entropy = torch.rand(t.mask.shape, generator=g)
    t.ref_log_probs = t.old_log_probs + 0.2 * torch.randn(t.mask.shape, generator=g)
    cfg = LossConfig(use_tis=True, use_kl_loss=True, kl_loss_coef=0.1, entropy_coef=0.01)
    _, metrics, _ = _loss(cfg, t, _hooks("reject_first_token"))
    _, plain, _ = _loss(cfg, t, _hooks("clamp_tis", tis_clip=1e9, tis_clip_low=0.0))  # weights = ratio

    def kept_mean(values: torch.Tensor, first: int) -> torch.Tensor:
        return sum(
            (values[i, first:n] * t.mask[i, first:n]).sum() / (t.mask[i, :n].sum() * NUM_SAMPLES)
            for i, n in enumerate(LENGTHS)
        )

    torch.testing.assert_close(metrics["entropy"], kept_mean(t.entropy, 1))
    torch.testing.assert_close(plain["entropy"], kept_mean(t.entropy, 0))
    kl = losses.approx_kl(t.log_probs.detach(), t.ref_log_probs, "k1")
    torch.testing.assert_close(metrics["kl_loss"], kept_mean(kl, 1))
    torch.testing.assert_close(
        metrics["ois"], kept_mean(torch.exp(t.log_probs.detach() - t.old_log_probs), 0)
    )


@pytest.mark.parametrize("per_token", [False, True])
def test_slimes_default_reduction_as_a_reducer_changes_nothing(per_token):
    cfg = LossConfig(calculate_per_token_loss=per_token)
    t = _terms(per_token)
    plain = _loss(cfg, t)
    reduced = _loss(cfg, t, _hooks(reducer="sample_mean_reducer"))
    torch.testing.assert_close(reduced[0], plain[0])
    torch.testing.assert_close(reduced[2], plain[2])


def test_a_reducer_replaces_the_policy_loss_reduction_only():
    cfg = LossConfig(entropy_coef=0.0)
    t = _terms()
    plain = _loss(cfg, t)
    loss, metrics, _ = _loss(cfg, t, _hooks(reducer="token_sum_over_constant"))
    pg, _ = losses.ppo_policy_loss(t.old_log_probs - t.log_probs.detach(), t.advantages, 0.2, 0.2)
    expected = (pg * t.mask).sum() / 8.0 / NUM_SAMPLES
    torch.testing.assert_close(metrics["pg_loss"], expected)
    torch.testing.assert_close(loss, expected)
    assert metrics["ppo_kl"] == plain[1]["ppo_kl"] and metrics["pg_clipfrac"] == plain[1]["pg_clipfrac"]


def test_the_reducer_sees_the_masks_the_tis_hook_returned():
    cfg = LossConfig(use_tis=True)
    t = _terms()
    both = _loss(cfg, t, _hooks("reject_first_token", "sample_mean_reducer"))
    tis_only = _loss(cfg, t, _hooks("reject_first_token"))
    # slime's reducer over the kept tokens divides by the kept count; the built-in keeps the original.
    assert not torch.allclose(both[0], tis_only[0])
    pg, _ = losses.ppo_policy_loss(t.old_log_probs - t.log_probs.detach(), t.advantages, 0.2, 0.2)
    kept = t.mask.clone()
    kept[:, 0] = 0
    expected = sum((pg[i] * kept[i]).sum() / kept[i].sum() for i in range(len(LENGTHS))) / NUM_SAMPLES
    torch.testing.assert_close(both[0], expected)


def test_a_hook_returning_the_wrong_shape_names_the_flag():
    with pytest.raises(
        ValueError, match=r"--custom-tis-function-path: the returned pg_loss .*\(12\), got \(11,\)"
    ):
        micro_batch_loss(LossConfig(use_tis=True), _terms(), _hooks("wrong_length_tis"))


def test_hook_flag_rules():
    with pytest.raises(ValueError, match="only with --use-tis"):
        LossConfig(custom_tis_function_path=f"{HOOKS}.clamp_tis")
    with pytest.raises(ValueError, match="--custom-pg-loss-reducer-function-path reduces the policy loss"):
        LossConfig(loss_type="sft_loss", custom_pg_loss_reducer_function_path=f"{HOOKS}.sample_mean_reducer")


def _samples(rewards: list[float], n: int) -> list[Sample]:
    return [
        Sample(index=i, group_index=i // n, tokens=[1, 2, 3], response_length=1, reward=r)
        for i, r in enumerate(rewards)
    ]


def test_reward_post_process_rewards_are_what_trains():
    from slime.config.train import BatchConfig

    args = argparse.Namespace(n_samples_per_prompt=2)
    post = reward_post_process(f"{HOOKS}.group_mean_only", args)
    metrics: dict[str, float] = {}
    rollout = package_rollout(
        0, _samples([1.0, 0.0, 1.0, 1.0], 2), None, (BatchConfig(), 1), lambda p: p, metrics, post
    )
    (part,) = rollout.parts
    assert part.rewards == [0.5, -0.5, 0.0, 0.0] and part.rewards_normalized
    assert part.batch.rewards == part.rewards and part.batch.rewards_normalized
    assert metrics["rollout/post_processed_reward_mean"] == 0.0
    assert loss_hooks.group_mean_only(args, _samples([2.0, 0.0], 2))[0] == [2.0, 0.0]  # raw kept by the hook


def test_reward_post_process_must_give_one_reward_per_sample():
    from slime.config.train import BatchConfig

    post = reward_post_process(f"{HOOKS}.one_short", argparse.Namespace())
    with pytest.raises(
        ValueError, match="--custom-reward-post-process-path returned 2 rewards for 3 samples"
    ):
        package_rollout(0, _samples([1.0, 0.0, 1.0], 3), None, (BatchConfig(), 1), lambda p: p, {}, post)


def test_mismatch_metrics_come_from_the_tis_hook_without_use_tis():
    """--get-mismatch-metrics: the hook runs and reports (train/ois, its own metrics); a hook that
    returns the loss unchanged (slime's mis.py without --use-tis) leaves the training as it was."""
    t = _terms()
    plain = _loss(LossConfig(), t)
    cfg = LossConfig(get_mismatch_metrics=True, custom_tis_function_path=f"{HOOKS}.report_only_tis")
    measured = _loss(cfg, t, _hooks("report_only_tis"))
    torch.testing.assert_close(measured[0], plain[0])
    torch.testing.assert_close(measured[2], plain[2])
    assert "ois" in measured[1] and "mis_log_ppl_diff" in measured[1] and "ois" not in plain[1]
    with pytest.raises(ValueError, match="--get-mismatch-metrics"):
        LossConfig(get_mismatch_metrics=True)
