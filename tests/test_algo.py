"""slime/algo against hand-computed examples."""

from __future__ import annotations

import math

import pytest
import torch

from slime.algo import advantages as adv
from slime.algo import losses
from slime.algo.objective import LossConfig, MicroBatchTerms, micro_batch_loss


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


# ---- group reward normalisation -------------------------------------------------------------
def test_grpo_group_mean_and_unbiased_std():
    # group 0: rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3); group 1: 2, 4 -> mean 3, std sqrt(2)
    out = adv.normalize_group_rewards([1, 0, 0, 1, 2, 4], [0, 0, 0, 0, 1, 1], "grpo")
    s0 = math.sqrt(1 / 3) + 1e-6
    s1 = math.sqrt(2) + 1e-6
    expected = t(0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0, -1 / s1, 1 / s1)
    torch.testing.assert_close(out, expected)


def test_grpo_without_std_and_gspo_share_it():
    out = adv.normalize_group_rewards([1, 0, 0, 1], [7, 7, 7, 7], "grpo", std_normalization=False)
    torch.testing.assert_close(out, t(0.5, -0.5, -0.5, 0.5))
    gspo = adv.normalize_group_rewards([1, 0, 0, 1], [7, 7, 7, 7], "gspo")
    torch.testing.assert_close(gspo, adv.normalize_group_rewards([1, 0, 0, 1], [7, 7, 7, 7], "grpo"))


def test_rloo_leave_one_out_baseline():
    # r = 1, 2, 6: baselines (2+6)/2=4, (1+6)/2=3.5, (1+2)/2=1.5
    out = adv.normalize_group_rewards([1, 2, 6], [0, 0, 0], "rloo")
    torch.testing.assert_close(out, t(1 - 4, 2 - 3.5, 6 - 1.5))


def test_reinforce_baseline_and_plain():
    torch.testing.assert_close(
        adv.normalize_group_rewards([1, 3], [0, 0], "reinforce_plus_plus_baseline"), t(-1.0, 1.0)
    )
    torch.testing.assert_close(
        adv.normalize_group_rewards([1, 3], [0, 0], "reinforce_plus_plus"), t(1.0, 3.0)
    )


def test_groups_are_found_by_index_not_position_and_singletons_get_zero():
    out = adv.normalize_group_rewards([1, 5, 3, 9], [0, 1, 0, 2], "grpo", std_normalization=False)
    torch.testing.assert_close(out, t(-1.0, 0.0, 1.0, 0.0))


def test_an_execution_split_into_several_samples_counts_once_in_its_group():
    # Group of two sessions: one split into three samples (reward 1), one kept whole (reward 0):
    # mean 0.5, std over the two sessions sqrt(1/2), not over four samples.
    out = adv.normalize_group_rewards([1, 1, 1, 0], [0, 0, 0, 0], "grpo", executions=[4, 4, 4, 9])
    s = math.sqrt(0.5) + 1e-6
    torch.testing.assert_close(out, t(0.5 / s, 0.5 / s, 0.5 / s, -0.5 / s))
    # rloo's n is the number of sessions too; one execution alone has no baseline.
    rloo = adv.normalize_group_rewards([1, 1, 0, 3], [0, 0, 0, 1], "rloo", executions=[1, 1, 2, 3])
    torch.testing.assert_close(rloo, t(1.0, 1.0, -1.0, 0.0))
    # Each sample is still scored with its own reward.
    own = adv.normalize_group_rewards([2, 0, 1], [0, 0, 0], "grpo", False, executions=[0, 0, 1])
    torch.testing.assert_close(own, t(1.0, -1.0, 0.0))


def test_unknown_estimator_is_rejected():
    with pytest.raises(ValueError, match="advantage estimator"):
        adv.normalize_group_rewards([1.0], [0], "ppo2")


# ---- per-token advantages -------------------------------------------------------------------
def test_grpo_advantage_broadcast_over_masked_tokens():
    out = adv.compute_advantages("grpo", t(0.5, -2.0), [t(1, 1, 0), t(0, 1)])
    torch.testing.assert_close(out[0], t(0.5, 0.5, 0.0))
    torch.testing.assert_close(out[1], t(0.0, -2.0))


def test_reinforce_plus_plus_discounted_returns_with_kl_penalty():
    # kl_coef 0.1, gamma 0.5, kl = (1, 2, 3), reward 1 on the last token:
    # x = (-0.1, -0.2, -0.3 + 1) ; G2 = 0.7 ; G1 = -0.2 + 0.35 = 0.15 ; G0 = -0.1 + 0.075 = -0.025
    out = adv.compute_advantages(
        "reinforce_plus_plus", t(1.0), [t(1, 1, 1)], kl=[t(1, 2, 3)], kl_coef=0.1, gamma=0.5
    )
    torch.testing.assert_close(out[0], t(-0.025, 0.15, 0.7))


def test_reinforce_plus_plus_masked_token_does_not_advance_discount():
    # mask (1, 0, 1): the middle token is skipped; G2 = 1, G0 = 0 + 0.5 * 1
    out = adv.compute_advantages("reinforce_plus_plus", t(1.0), [t(1, 0, 1)], gamma=0.5)
    torch.testing.assert_close(out[0], t(0.5, 0.0, 1.0))


def test_reinforce_baseline_subtracts_kl():
    out = adv.compute_advantages(
        "reinforce_plus_plus_baseline", t(2.0), [t(1, 1)], kl=[t(1.0, -1.0)], kl_coef=0.5
    )
    torch.testing.assert_close(out[0], t(1.5, 2.5))


def test_reinforce_needs_kl_when_coef_set():
    with pytest.raises(ValueError, match="--kl-coef"):
        adv.compute_advantages("reinforce_plus_plus", t(1.0), [t(1, 1)], kl=None, kl_coef=0.1)


def test_whitening_uses_global_stats_over_masked_tokens():
    values = [t(1, 2, 99), t(3, 4)]
    masks = [t(1, 1, 0), t(1, 1)]
    # split across two "ranks": stats add up
    stats = adv.whitening_stats(values[:1], masks[:1]) + adv.whitening_stats(values[1:], masks[1:])
    out = adv.whiten(values, masks, stats)
    # tokens 1,2,3,4: mean 2.5, biased var 1.25
    scale = 1 / math.sqrt(1.25 + 1e-8)
    torch.testing.assert_close(out[0], t(-1.5 * scale, -0.5 * scale, 0.0))
    torch.testing.assert_close(out[1], t(0.5 * scale, 1.5 * scale))


# ---- losses ---------------------------------------------------------------------------------
def test_kl_estimators_by_hand():
    lp, ref = t(-1.0, -2.0), t(-1.5, -2.0)  # d = 0.5, 0
    torch.testing.assert_close(losses.approx_kl(lp, ref, "k1"), t(0.5, 0.0))
    torch.testing.assert_close(losses.approx_kl(lp, ref, "k2"), t(0.125, 0.0))
    torch.testing.assert_close(losses.approx_kl(lp, ref, "k3"), t(math.exp(-0.5) - 1 + 0.5, 0.0))
    big = losses.approx_kl(t(0.0), t(-40.0), "low_var_kl")  # d = 40 -> clamp 20 -> 19+e^-20 -> clamp 10
    torch.testing.assert_close(big, t(10.0))
    for kind in losses.KL_TYPES:
        assert torch.equal(losses.approx_kl(lp, lp.clone(), kind), torch.zeros(2))


def test_ppo_clip_by_hand():
    # ratios: e^0.5 (above 1.2), e^-0.5 (below 0.8), 1.1 (inside)
    ppo_kl = t(-0.5, 0.5, -math.log(1.1))
    a = t(1.0, 1.0, -2.0)
    loss, clipfrac = losses.ppo_policy_loss(ppo_kl, a, eps_clip=0.2, eps_clip_high=0.2)
    # A>0, rho=1.6487: max(-1.6487, -1.2) = -1.2 (clipped); A>0, rho=0.6065: max(-0.6065, -0.8) = -0.6065
    # A<0, rho=1.1: max(2.2, 2.2) = 2.2
    torch.testing.assert_close(loss, t(-1.2, -math.exp(-0.5), 2.2))
    torch.testing.assert_close(clipfrac, t(1.0, 0.0, 0.0))


def test_asymmetric_clip_and_dual_clip():
    ppo_kl = t(-math.log(1.25), -math.log(5.0))
    loss, _ = losses.ppo_policy_loss(ppo_kl, t(1.0, -1.0), eps_clip=0.2, eps_clip_high=0.28)
    torch.testing.assert_close(loss, t(-1.25, 5.0))  # 1.25 inside (0.8, 1.28); A<0: max(5, 1.28) = 5
    dual, _ = losses.ppo_policy_loss(ppo_kl, t(1.0, -1.0), 0.2, 0.28, eps_clip_c=3.0)
    torch.testing.assert_close(dual, t(-1.25, 3.0))  # bounded by -c*A = 3


def test_tis_weights_clamped():
    w, clipped = losses.tis_weights(t(0.0, 0.0, 0.0), t(-2.0, 0.0, 1.0), clip_high=2.0, clip_low=0.5)
    torch.testing.assert_close(w, t(2.0, 1.0, 0.5))  # e^2 -> 2 ; 1 ; e^-1=0.37 -> 0.5
    torch.testing.assert_close(clipped, t(1.0, 0.0, 1.0))


def test_entropy_uniform_and_peaked():
    ent = losses.entropy_from_logits(torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(ent, t(math.log(4), 0.0), atol=1e-6, rtol=0)


def test_token_weights_per_sample_and_per_token():
    masks = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    w = losses.token_weights(masks, per_token=False, num_samples_global=4, num_tokens_global=0)
    torch.testing.assert_close(w[0], t(1 / 8, 1 / 8, 0, 0))
    torch.testing.assert_close(w[1], t(1 / 16, 1 / 16, 1 / 16, 1 / 16))
    w = losses.token_weights(masks, per_token=True, num_samples_global=0, num_tokens_global=12)
    torch.testing.assert_close(w[1], t(1 / 12, 1 / 12, 1 / 12, 1 / 12))


# ---- the objective --------------------------------------------------------------------------
def _terms(**kw):
    mask = torch.tensor([[1, 1, 0]])
    base = dict(
        log_probs=torch.tensor([[-1.0, -2.0, -5.0]]),
        mask=mask,
        weights=losses.token_weights(mask, False, 1, 0),
        old_log_probs=torch.tensor([[-1.0, -2.0, -5.0]]),
        advantages=torch.tensor([[1.0, 1.0, 0.0]]),
        ref_log_probs=torch.tensor([[-1.5, -2.0, -5.0]]),
        entropy=torch.tensor([[2.0, 4.0, 9.0]]),
    )
    base.update(kw)
    return MicroBatchTerms(**base)


def test_objective_combines_terms_by_hand():
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=0.5, entropy_coef=0.1)
    loss, m = micro_batch_loss(cfg, _terms())
    # ratio 1 -> pg = mean(-1, -1) = -1 ; entropy mean(2, 4) = 3 ; k1 = mean(0.5, 0) = 0.25
    assert m["pg_loss"].item() == pytest.approx(-1.0)
    assert m["entropy"].item() == pytest.approx(3.0)
    assert m["kl_loss"].item() == pytest.approx(0.25)
    assert loss.item() == pytest.approx(-1.0 - 0.1 * 3.0 + 0.5 * 0.25)
    assert m["ppo_kl"].item() == 0.0 and m["pg_clipfrac"].item() == 0.0


def test_objective_at_step0_has_exact_zero_kl():
    lp = torch.tensor([[-1.25, -2.5, -0.125]])
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="low_var_kl")
    _, m = micro_batch_loss(cfg, _terms(log_probs=lp, old_log_probs=lp.clone(), ref_log_probs=lp.clone()))
    assert m["kl_loss"].item() == 0.0 and m["ppo_kl"].item() == 0.0


def test_unbiased_kl_weights_each_token_by_the_ratio_to_the_old_policy():
    lp = torch.tensor([[-0.5, -2.0, -5.0]], requires_grad=True)
    old, ref = torch.tensor([[-1.0, -2.5, -5.0]]), torch.tensor([[-1.5, -2.0, -5.0]])
    cfg = LossConfig(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k3", use_unbiased_kl=True)
    loss, m = micro_batch_loss(cfg, _terms(log_probs=lp, old_log_probs=old, ref_log_probs=ref))
    # token 1: rho = e^0.5, d = 1 ; token 2: rho = e^0.5, d = 0 -> k3 = 0
    assert m["kl_loss"].item() == pytest.approx(math.exp(0.5) * (math.exp(-1) - 1 + 1) / 2)
    (g_unbiased,) = torch.autograd.grad(loss, lp)
    plain = LossConfig(use_kl_loss=True, kl_loss_coef=1.0, kl_loss_type="k3")
    loss2, m2 = micro_batch_loss(plain, _terms(log_probs=lp, old_log_probs=old, ref_log_probs=ref))
    assert m2["kl_loss"].item() == pytest.approx((math.exp(-1) - 1 + 1) / 2)
    (g_plain,) = torch.autograd.grad(loss2, lp)
    assert not torch.allclose(g_unbiased, g_plain)  # the ratio is not detached
    # low_var_kl clamps after the product
    big = losses.approx_kl(t(0.0), t(-15.0), "low_var_kl", ratio=t(0.5))
    assert big.item() == pytest.approx(0.5 * (math.exp(-15) - 1 + 15))
    assert losses.approx_kl(t(0.0), t(-15.0), "low_var_kl", ratio=t(2.0)).item() == 10.0
    with pytest.raises(ValueError, match=r"--use-unbiased-kl .*--use-kl-loss"):
        LossConfig(use_unbiased_kl=True)


def test_objective_gspo_uses_sequence_ratio():
    # token log-ratios 0.4 and 0 -> sequence mean 0.2, ratio e^0.2 = 1.2214 > 1.2 -> clipped for both tokens
    lp = torch.tensor([[-0.6, -2.0, -5.0]])
    _, m = micro_batch_loss(LossConfig(advantage_estimator="gspo"), _terms(log_probs=lp))
    assert m["pg_clipfrac"].item() == pytest.approx(1.0)
    assert m["pg_loss"].item() == pytest.approx(-1.2)
    _, m = micro_batch_loss(LossConfig(advantage_estimator="grpo"), _terms(log_probs=lp))
    assert m["pg_clipfrac"].item() == pytest.approx(0.5)  # only the first token (ratio e^0.4) clips


def test_objective_tis_and_sft():
    cfg = LossConfig(use_tis=True, tis_clip=2.0)
    _, m = micro_batch_loss(cfg, _terms(rollout_log_probs=torch.tensor([[-3.0, -2.0, 0.0]])))
    # weights (clamp(e^2)=2, 1) -> pg = mean(-2, -1) = -1.5 ; clipfrac 0.5 ; as slime, the tis metrics
    # report the ratio before the clamp: tis = mean(e^2, 1), tis_abs = mean(e^2 - 1, 0)
    assert m["pg_loss"].item() == pytest.approx(-1.5)
    assert m["tis"].item() == pytest.approx((math.exp(2) + 1) / 2) and m[
        "tis_clipfrac"
    ].item() == pytest.approx(0.5)
    assert m["tis_abs"].item() == pytest.approx((math.exp(2) - 1) / 2)
    loss, m = micro_batch_loss(LossConfig(loss_type="sft_loss"), _terms())
    assert loss.item() == pytest.approx(1.5)


@pytest.mark.parametrize(
    "kwargs, flag",
    [
        (dict(loss_type="dpo"), "--loss-type"),
        (dict(kl_loss_type="k9"), "--kl-loss-type"),
        (dict(eps_clip_c=0.5), "--eps-clip-c"),
        (dict(eps_clip=1.5), "--eps-clip"),
        (dict(use_tis=True, tis_clip=1.0, tis_clip_low=2.0), "--tis-clip-low"),
    ],
)
def test_loss_config_names_the_flag(kwargs, flag):
    with pytest.raises(ValueError, match=flag):
        LossConfig(**kwargs)


# ---- off-policy corrections -----------------------------------------------------------------
def test_opsm_keep_masks_negative_tokens_of_drifted_samples():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 0]])
    old = torch.zeros(4, 3)
    # mean old - new over the loss tokens: 0.5 (the excluded token's -9 does not count), 1e-4 (not
    # above delta), 0.3, 0.5
    new = torch.tensor([[-0.5, -0.5, 9.0], [-1e-4, -1e-4, -1e-4], [-0.3, -0.3, -0.3], [-0.5, -0.5, 0.0]])
    adv = torch.tensor([[-1.0, 2.0, -1.0], [-1.0, -1.0, -1.0], [1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    keep = losses.opsm_keep(new, old, adv, mask, delta=1e-4)
    # row 0: only the negative-advantage tokens; row 1: kl == delta keeps all; row 2: A > 0 keeps all
    expected = torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 1.0]])
    torch.testing.assert_close(keep, expected)


def _two_samples(**kw):
    """Sample 0 (2 loss tokens) drifted: new = old - 0.2, so kl_0 = 0.2 and ratio e^-0.2 = 0.819
    (inside the clip); sample 1 (3 loss tokens) on-policy. Both have advantage -1."""
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    old = torch.full((2, 3), -1.0)
    base = dict(
        log_probs=torch.tensor([[-1.2, -1.2, -1.0], [-1.0, -1.0, -1.0]]).requires_grad_(),
        mask=mask,
        weights=losses.token_weights(mask, False, 2, 5),
        old_log_probs=old,
        advantages=torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -1.0, -1.0]]),
    )
    base.update(kw)
    return MicroBatchTerms(**base)


def test_objective_opsm_by_hand():
    rho = math.exp(-0.2)
    _, m = micro_batch_loss(LossConfig(), _two_samples())
    assert m["pg_loss"].item() == pytest.approx(rho / 2 + 1 / 2)  # L = -rho A = rho, and 1
    t = _two_samples()
    loss, m = micro_batch_loss(LossConfig(use_opsm=True), t)
    # sample 0's tokens (A < 0, kl 0.2 > 1e-4) leave the loss; its normaliser stays (mean of 0, 0)
    assert m["pg_loss"].item() == pytest.approx(0 / 2 + 1 / 2)
    assert m["opsm_clipfrac"].item() == pytest.approx(
        (2 / 2 + 0 / 3) / 2
    )  # slime's: mean of per-sample shares
    (grad,) = torch.autograd.grad(loss, t.log_probs)
    assert grad[0].abs().sum() == 0 and grad[1, :3].abs().min() > 0
    # --calculate-per-token-loss: the masked share of the step's loss tokens (slime: 1 sample / 5 tokens)
    _, m = micro_batch_loss(
        LossConfig(use_opsm=True, calculate_per_token_loss=True),
        _two_samples(weights=losses.token_weights(torch.tensor([[1, 1, 0], [1, 1, 1]]), True, 2, 5)),
    )
    assert m["opsm_clipfrac"].item() == pytest.approx(2 / 5)
    # the threshold: a delta above the drift masks nothing
    _, m = micro_batch_loss(LossConfig(use_opsm=True, opsm_delta=0.25), _two_samples())
    assert m["opsm_clipfrac"].item() == 0.0 and m["pg_loss"].item() == pytest.approx(rho / 2 + 1 / 2)


def test_objective_opsm_then_tis():
    # TIS weights (engine 0.5 below the trainer everywhere): clamp(e^0.5 = 1.65, 0, 2) = e^0.5
    rollout = torch.full((2, 3), -1.5)
    _, m = micro_batch_loss(LossConfig(use_opsm=True, use_tis=True), _two_samples(rollout_log_probs=rollout))
    assert m["pg_loss"].item() == pytest.approx((0 + math.exp(0.5)) / 2)
    assert m["opsm_clipfrac"].item() == pytest.approx(0.5)


def test_behaviour_weights_mask_above_the_cap():
    proximal = t(0.0, 0.0, 0.0, 0.0)
    engine = t(-2.0, 0.0, 1.0, -0.5)  # w = e^2 = 7.39, 1, e^-1 = 0.37, e^0.5 = 1.65
    w, masked = losses.behaviour_weights(proximal, engine, cap=2.0)
    torch.testing.assert_close(w, t(0.0, 1.0, math.exp(-1), math.exp(0.5)))  # masked, not clamped to 2
    torch.testing.assert_close(masked, t(1.0, 0.0, 0.0, 0.0))
    w, masked = losses.behaviour_weights(proximal, engine, cap=None)
    torch.testing.assert_close(w, t(math.exp(2), 1.0, math.exp(-1), math.exp(0.5)))
    assert masked.sum() == 0


def test_objective_decoupled_loss_by_hand():
    # The ratio is against the proximal (old) policy: new - old = 0.1, 0 -> rho = e^0.1 (inside the
    # clip), 1; A = 1 -> L = -e^0.1, -1. Behaviour weights exp(old - engine) = e^2, e^0.5.
    lp = torch.tensor([[-0.9, -2.0, -5.0]], requires_grad=True)
    rollout = torch.tensor([[-3.0, -2.5, 0.0]])
    cfg = LossConfig(use_decoupled_loss=True, behav_imp_weight_cap=10.0)
    assert cfg.needs_rollout_log_probs
    loss, m = micro_batch_loss(cfg, _terms(log_probs=lp, rollout_log_probs=rollout))
    assert m["pg_loss"].item() == pytest.approx((-math.exp(0.1) * math.exp(2) - math.exp(0.5)) / 2)
    assert m["behav_imp_weight"].item() == pytest.approx((math.exp(2) + math.exp(0.5)) / 2)
    assert m["behav_mask_frac"].item() == 0.0
    (grad,) = torch.autograd.grad(loss, lp)  # d(-rho A w)/d log p = -rho A w (w carries no gradient)
    torch.testing.assert_close(grad, torch.tensor([[-math.exp(2.1) / 2, -math.exp(0.5) / 2, 0.0]]))
    # cap 2: the first token (w = e^2) is masked: weight 0, its sample's normaliser kept
    cfg = LossConfig(use_decoupled_loss=True, behav_imp_weight_cap=2.0)
    loss, m = micro_batch_loss(cfg, _terms(log_probs=lp, rollout_log_probs=rollout))
    assert m["pg_loss"].item() == pytest.approx(-math.exp(0.5) / 2)
    assert m["behav_imp_weight"].item() == pytest.approx(math.exp(0.5) / 2)
    assert m["behav_mask_frac"].item() == pytest.approx(0.5)
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad[0, 0] == 0


def test_off_policy_metrics_add_up_over_micro_batches():
    # Global weights make every metric a sum: the two halves of a batch add up to the whole.
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(4, 5)
    mask[1, 3:] = 0
    mask[2, 0] = 0
    old = -2 + 0.3 * torch.randn(4, 5, generator=g)
    whole = MicroBatchTerms(
        log_probs=old + 0.2 * torch.randn(4, 5, generator=g),
        mask=mask,
        weights=losses.token_weights(mask, False, 4, int(mask.sum())),
        old_log_probs=old,
        advantages=torch.tensor([[-1.0], [1.0], [-0.5], [-2.0]]).expand(4, 5).clone(),
        rollout_log_probs=old + 0.5 * torch.randn(4, 5, generator=g),
    )
    cfg = LossConfig(use_opsm=True, opsm_delta=0.0, use_decoupled_loss=True, behav_imp_weight_cap=1.5)
    _, full = micro_batch_loss(cfg, whole)
    halves = [
        micro_batch_loss(
            cfg, MicroBatchTerms(**{k: v[rows] for k, v in vars(whole).items() if torch.is_tensor(v)})
        )[1]
        for rows in (slice(0, 2), slice(2, 4))
    ]
    assert 0 < full["opsm_clipfrac"] < 1 and 0 < full["behav_mask_frac"] < 1
    for name in ("opsm_clipfrac", "behav_imp_weight", "behav_mask_frac", "pg_loss"):
        torch.testing.assert_close(halves[0][name] + halves[1][name], full[name])


@pytest.mark.parametrize(
    "kwargs, flags",
    [
        (
            dict(use_decoupled_loss=True, use_rollout_logprobs=True),
            ("--use-decoupled-loss", "--use-rollout-logprobs"),
        ),
        (dict(use_decoupled_loss=True, use_tis=True), ("--use-decoupled-loss", "--use-tis")),
        (
            dict(use_decoupled_loss=True, loss_type="sft_loss", compute_advantages_and_returns=False),
            ("--use-decoupled-loss", "--loss-type sft_loss"),
        ),
        (
            dict(use_decoupled_loss=True, behav_imp_weight_cap=1.0),
            ("--behav-imp-weight-cap", "--use-decoupled-loss"),
        ),
        (dict(behav_imp_weight_cap=5.0), ("--behav-imp-weight-cap", "--use-decoupled-loss")),
        (dict(use_opsm=True, loss_type="sft_loss"), ("--use-opsm", "--loss-type sft_loss")),
    ],
)
def test_off_policy_corrections_refuse_combinations_naming_both_flags(kwargs, flags):
    with pytest.raises(ValueError) as e:
        LossConfig(**kwargs)
    assert all(f in str(e.value) for f in flags), str(e.value)


# ---- PPO with a critic, on-policy distillation (issue 24) --------------------------------------


def test_gae_by_hand():
    from slime.algo.advantages import gae

    rewards, values = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.2, 0.4])
    adv, ret = gae(rewards, values, gamma=0.9, lambd=0.8)
    # t=2: 1 - 0.4 = 0.6; t=1: 0.9*0.4 - 0.2 + 0.72*0.6 = 0.592; t=0: 0.9*0.2 - 0.5 + 0.72*0.592
    assert torch.allclose(adv, torch.tensor([0.10624, 0.592, 0.6]))
    assert torch.allclose(ret, torch.tensor([0.60624, 0.792, 1.0]))
    # gamma = lambda = 1: the return of every token is the reward to come (Monte Carlo).
    adv, ret = gae(rewards, values, gamma=1.0, lambd=1.0)
    assert torch.allclose(ret, torch.ones(3)) and torch.allclose(adv, 1.0 - values)
    with pytest.raises(ValueError, match="3 token rewards but 2 values"):
        gae(rewards, values[:2], 1.0, 1.0)


def test_ppo_token_rewards_put_the_reward_on_the_last_token_and_the_kl_on_all():
    from slime.algo.advantages import ppo_token_rewards

    kl = torch.tensor([0.1, -0.2, 0.3])
    assert torch.allclose(ppo_token_rewards(2.0, 3, kl, 0.5), torch.tensor([-0.05, 0.1, 1.85]))
    assert torch.equal(ppo_token_rewards(1.0, 2, None, 0.5), torch.tensor([0.0, 1.0]))


def test_opd_penalty_subtracts_the_reverse_kl_per_token():
    from slime.algo.advantages import opd_penalty

    out = opd_penalty(
        [torch.tensor([1.0, 1.0])], [torch.tensor([-1.0, -2.0])], [torch.tensor([-1.5, -1.0])], 0.5
    )
    assert torch.allclose(out[0], torch.tensor([0.75, 1.5]))
    masked = opd_penalty(
        [torch.tensor([0.0, 1.0])],
        [torch.tensor([-1.0, -2.0])],
        [torch.tensor([-1.5, -1.0])],
        0.5,
        [torch.tensor([0, 1])],
    )
    assert torch.allclose(masked[0], torch.tensor([0.0, 1.5]))  # a token outside the loss keeps its 0
    with pytest.raises(ValueError, match="sample 0: 2 advantages, 2 student and 1 teacher"):
        opd_penalty([torch.ones(2)], [torch.ones(2)], [torch.ones(1)], 1.0)


def test_value_loss_clips_around_the_old_values():
    from slime.algo.losses import value_loss

    values, old, returns = (
        torch.tensor([1.0, 0.0, 0.6]),
        torch.tensor([0.5, 0.5, 0.5]),
        torch.tensor([2.0, 0.0, 0.0]),
    )
    loss, clipfrac = value_loss(values, old, returns, clip=0.2)
    # token 0: clipped 0.7 -> max(1, 1.69); token 1: clipped 0.3 -> max(0, 0.09); token 2: inside the clip
    assert torch.allclose(loss, torch.tensor([1.69, 0.09, 0.36]))
    assert clipfrac.tolist() == [1.0, 1.0, 0.0]


def test_explained_variance():
    from slime.algo.advantages import explained_variance, explained_variance_of

    returns, mask = (
        [torch.tensor([1.0, 2.0, 3.0]), torch.tensor([4.0, 100.0])],
        [torch.ones(3), torch.tensor([1, 0])],
    )
    perfect = explained_variance([r.clone() for r in returns], returns, mask)
    assert explained_variance_of(perfect) == pytest.approx(1.0)
    assert explained_variance_of(
        explained_variance([torch.zeros(3), torch.zeros(2)], returns, mask)
    ) == pytest.approx(0.0)
    # V = R - noise: 1 - Var(noise) / Var(R) over the masked tokens (the 100 is masked out)
    noise = [torch.tensor([0.5, -0.5, 0.5]), torch.tensor([-0.5, 7.0])]
    stats = explained_variance([r - e for r, e in zip(returns, noise)], returns, mask)
    var_r = torch.tensor([1.0, 2.0, 3.0, 4.0]).var(unbiased=False)
    var_e = torch.tensor([0.5, -0.5, 0.5, -0.5]).var(unbiased=False)
    assert explained_variance_of(stats) == pytest.approx(float(1 - var_e / var_r))
    # Equal returns: undefined (nan), not rounding noise divided by rounding noise.
    same = [torch.full((3,), 0.1), torch.full((2,), 0.1)]
    assert math.isnan(explained_variance_of(explained_variance([torch.zeros(3), torch.zeros(2)], same, mask)))
    # Sums add over ranks: two halves give the whole.
    halves = explained_variance([returns[0] - noise[0]], returns[:1], mask[:1]) + explained_variance(
        [returns[1] - noise[1]], returns[1:], mask[1:]
    )
    assert torch.allclose(halves, stats)
