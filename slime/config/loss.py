"""The train objective's settings (--loss-type, --advantage-estimator, the clip and KL flags) and
the names they accept; no torch here, so parsing flags does not import it."""

from __future__ import annotations

from dataclasses import dataclass

from slime.config.flags import flag

ESTIMATORS = ("grpo", "gspo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo", "ppo")
KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
LOSS_TYPES = ("policy_loss", "sft_loss")


@dataclass(frozen=True)
class LossConfig:
    """What the train step optimises (slime's flag names in parentheses)."""

    loss_type: str = flag("--loss-type", "policy_loss", choices=LOSS_TYPES)
    """`--loss-type`: policy_loss (PPO-style RL) or sft_loss (negative log-likelihood)."""
    advantage_estimator: str = flag("--advantage-estimator", "grpo", choices=ESTIMATORS)
    """`--advantage-estimator`: grpo, gspo, reinforce_plus_plus, reinforce_plus_plus_baseline, rloo,
    ppo (GAE over a critic's values: slime.backends.fsdp.critic)."""
    disable_grpo_std_normalization: bool = flag("--disable-grpo-std-normalization", False)
    """`--disable-grpo-std-normalization`: GRPO/GSPO subtract the group mean only."""
    normalize_advantages: bool = flag("--normalize-advantages", False)
    """`--normalize-advantages`: whiten advantages over every response token of the rollout."""
    eps_clip: float = flag("--eps-clip", 0.2)
    """`--eps-clip`: lower clip range, ratio >= 1 - eps_clip."""
    eps_clip_high: float | None = flag("--eps-clip-high", None, type=float)
    """`--eps-clip-high`: upper clip range (default: eps_clip)."""
    eps_clip_c: float | None = flag("--eps-clip-c", None, type=float)
    """`--eps-clip-c`: dual-clip bound (> 1) for negative advantages; off when None."""
    use_kl_loss: bool = flag("--use-kl-loss", False)
    """`--use-kl-loss`: add kl_loss_coef * KL(actor || reference) to the loss."""
    kl_loss_coef: float = flag("--kl-loss-coef", 0.0)
    """`--kl-loss-coef`: the weight of the KL term (--use-kl-loss)."""
    kl_loss_type: str = flag("--kl-loss-type", "k1", choices=KL_TYPES)
    """`--kl-loss-type`: k1, k2, k3, low_var_kl."""
    use_unbiased_kl: bool = flag("--use-unbiased-kl", False)
    """with --use-kl-loss: each token's KL estimate times p / p_old (the importance ratio to the
    policy that generated it; gradient through it), DeepSeek-V3.2's unbiased estimator"""
    ref_update_interval: int | None = flag("--ref-update-interval", None, type=int)
    """every N rollouts, after training, the reference model becomes the actor's weights (as slime;
    kept in memory, not in checkpoints: a resumed run starts from --ref-load again)"""
    kl_coef: float = flag("--kl-coef", 0.0)
    """KL penalty in the token rewards (REINFORCE++, PPO)"""
    gamma: float = flag("--gamma", 1.0)
    """discount (REINFORCE++ returns, PPO's GAE)"""
    lambd: float = flag("--lambd", 1.0)
    """GAE's lambda (PPO)"""
    value_clip: float = flag("--value-clip", 0.2)
    """the critic's value loss clips V - V_old (PPO)"""
    entropy_coef: float = flag("--entropy-coef", 0.0)
    """`--entropy-coef`: subtract entropy_coef * entropy from the loss."""
    keep_old_actor: bool = flag("--keep-old-actor", False)
    """the old policy's log-probs come from the weights that generated the rollout (kept in host
    memory at every push), not the weights being trained: they differ one step off-policy
    (train_async.py) and with --update-weights-interval"""
    use_rollout_entropy: bool = flag("--use-rollout-entropy", False)
    """the log-prob passes also measure each token's entropy (at --rollout-temperature):
    rollout/entropy and rollout/ref_entropy, token means over the loss mask"""
    use_tis: bool = flag("--use-tis", False)
    """`--use-tis`: truncated importance sampling against the engine's log-probs."""
    get_mismatch_metrics: bool = flag("--get-mismatch-metrics", False)
    """with --custom-tis-function-path: call it on every micro-batch for its train/rollout mismatch
    metrics (train/ois and the function's, e.g. slime's mis.py: train/mis_*), without --use-tis;
    the loss is what the function returns (slime's mis.py leaves it unchanged without --use-tis)"""
    tis_clip: float = flag("--tis-clip", 2.0)
    """`--tis-clip`: upper bound of the TIS weight."""
    tis_clip_low: float = flag("--tis-clip-low", 0.0)
    """`--tis-clip-low`: lower bound of the TIS weight."""
    use_opsm: bool = flag("--use-opsm", False)
    """off-policy sequence masking (as slime): in a sample whose mean log-ratio old - new over its
    loss tokens exceeds --opsm-delta, the negative-advantage tokens leave the policy loss"""
    opsm_delta: float = flag("--opsm-delta", 1e-4)
    """the threshold of --use-opsm"""
    use_decoupled_loss: bool = flag("--use-decoupled-loss", False)
    """AReaL's decoupled PPO: the ratio against the recomputed log-probs (proximal policy), each
    token's loss times exp(proximal - engine log-prob), the behaviour importance weight"""
    behav_imp_weight_cap: float | None = flag("--behav-imp-weight-cap", None, type=float)
    """with --use-decoupled-loss: tokens whose behaviour importance weight exceeds it (> 1) leave
    the loss (masked, not clamped as --tis-clip does)"""
    calculate_per_token_loss: bool = flag("--calculate-per-token-loss", False)
    """`--calculate-per-token-loss`: average over tokens of the batch instead of per sample."""
    use_rollout_logprobs: bool = flag("--use-rollout-logprobs", False)
    """the engine's log-probs are the old policy of the PPO ratio (no recompute pass)"""
    compute_advantages_and_returns: bool = flag(
        "--disable-compute-advantages-and-returns",
        True,
        dest="compute_advantages_and_returns",
        action="store_false",
    )
    """no log-prob passes and no advantages (with --loss-type sft_loss)"""
    rewards_normalization: bool = flag(
        "--disable-rewards-normalization", True, dest="rewards_normalization", action="store_false"
    )
    """no group baseline: advantages from the raw rewards"""
    custom_tis_function_path: str | None = flag("--custom-tis-function-path", None, metavar="module.function")
    """with --use-tis: slime's TIS hook fn(args, *, pg_loss, train_log_probs, rollout_log_probs,
    loss_masks, total_lengths, response_lengths) -> (pg_loss, loss_masks, metrics)"""
    custom_pg_loss_reducer_function_path: str | None = flag(
        "--custom-pg-loss-reducer-function-path", None, metavar="module.function"
    )
    """slime's pg_loss reducer factory(total_lengths, response_lengths, loss_masks,
    calculate_per_token_loss) -> reduce(pg_loss)"""

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"--loss-type {self.loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
        if self.advantage_estimator not in ESTIMATORS:
            raise ValueError(
                f"--advantage-estimator {self.advantage_estimator!r} is not one of {', '.join(ESTIMATORS)}"
            )
        if self.kl_loss_type not in KL_TYPES:
            raise ValueError(f"--kl-loss-type {self.kl_loss_type!r} is not one of {', '.join(KL_TYPES)}")
        if not 0 < self.eps_clip < 1:
            raise ValueError(f"--eps-clip must be in (0, 1), got {self.eps_clip}")
        if self.eps_clip_high is not None and self.eps_clip_high <= 0:
            raise ValueError(f"--eps-clip-high must be > 0, got {self.eps_clip_high}")
        if self.eps_clip_c is not None and self.eps_clip_c <= 1:
            raise ValueError(f"--eps-clip-c must be > 1, got {self.eps_clip_c}")
        if self.use_rollout_logprobs and self.use_tis:
            raise ValueError(
                "--use-rollout-logprobs makes the engine's log-probs the old policy, so --use-tis (which "
                "weights by old / engine) would be 1 everywhere: give one of them"
            )
        if not self.compute_advantages_and_returns and self.loss_type == "policy_loss":
            raise ValueError(
                "--disable-compute-advantages-and-returns leaves the policy loss without advantages: use "
                "it with --loss-type sft_loss"
            )
        if self.get_mismatch_metrics and self.custom_tis_function_path is None:
            raise ValueError(
                "--get-mismatch-metrics reports what --custom-tis-function-path computes (slime's "
                "examples/train_infer_mismatch_helper/mis.py): give the function"
            )
        if self.use_rollout_entropy and self.use_rollout_logprobs:
            raise ValueError(
                "--use-rollout-entropy measures the entropy in the trainer's log-prob pass, which "
                "--use-rollout-logprobs skips: drop one of them"
            )
        if self.keep_old_actor and self.use_rollout_logprobs:
            raise ValueError(
                "--keep-old-actor recomputes the old policy's log-probs with the generating weights, which "
                "--use-rollout-logprobs replaces with the engine's: give one of them"
            )
        if self.get_mismatch_metrics and self.use_rollout_logprobs:
            raise ValueError(
                "--get-mismatch-metrics compares the trainer's recomputed log-probs with the engine's, which "
                "--use-rollout-logprobs skips: drop one of them"
            )
        if self.custom_tis_function_path is not None and not (self.use_tis or self.get_mismatch_metrics):
            raise ValueError(
                "--custom-tis-function-path is called only with --use-tis (as in slime): add --use-tis, "
                "or drop the function"
            )
        if self.custom_pg_loss_reducer_function_path is not None and self.loss_type != "policy_loss":
            raise ValueError(
                "--custom-pg-loss-reducer-function-path reduces the policy loss: use --loss-type policy_loss"
            )
        if self.use_tis and not 0 <= self.tis_clip_low < self.tis_clip:
            raise ValueError(
                f"--tis-clip-low ({self.tis_clip_low}) must be >= 0 and below --tis-clip ({self.tis_clip})"
            )
        if self.ref_update_interval is not None and (self.ref_update_interval < 1 or not self.needs_ref):
            raise ValueError(
                f"--ref-update-interval must be >= 1 (got {self.ref_update_interval})"
                if self.ref_update_interval < 1
                else "--ref-update-interval refreshes the reference model, which no loss term uses here: add "
                "--use-kl-loss (or --kl-coef), or drop --ref-update-interval"
            )
        if self.use_unbiased_kl and not self.use_kl_loss:
            raise ValueError(
                "--use-unbiased-kl weights the KL loss, which is off: add --use-kl-loss, or drop "
                "--use-unbiased-kl (slime ignores it without --use-kl-loss)"
            )
        self._check_off_policy_corrections()

    def _check_off_policy_corrections(self) -> None:
        """--use-opsm, --use-decoupled-loss and --behav-imp-weight-cap against the rest."""
        if self.use_opsm and self.loss_type != "policy_loss":
            raise ValueError(
                "--use-opsm masks tokens of the policy loss, which --loss-type sft_loss does not compute: "
                "drop --use-opsm, or use --loss-type policy_loss"
            )
        if self.behav_imp_weight_cap is not None and not self.use_decoupled_loss:
            raise ValueError(
                "--behav-imp-weight-cap masks tokens of the decoupled loss: add --use-decoupled-loss, or "
                "drop --behav-imp-weight-cap"
            )
        if self.behav_imp_weight_cap is not None and self.behav_imp_weight_cap <= 1:
            raise ValueError(
                f"--behav-imp-weight-cap must be > 1 (got {self.behav_imp_weight_cap}): a token whose engine "
                "and trainer agree has weight 1 and must stay in the loss; give --use-decoupled-loss a cap "
                "above 1, or none"
            )
        if not self.use_decoupled_loss:
            return
        if self.loss_type != "policy_loss":
            raise ValueError(
                "--use-decoupled-loss weights the policy loss, which --loss-type sft_loss does not compute: "
                "drop --use-decoupled-loss, or use --loss-type policy_loss"
            )
        if self.use_rollout_logprobs:
            raise ValueError(
                "--use-decoupled-loss takes the PPO ratio against the trainer's recomputed log-probs (the "
                "proximal policy), which --use-rollout-logprobs skips: drop --use-rollout-logprobs"
            )
        if self.use_tis:
            raise ValueError(
                "--use-decoupled-loss already weights each token by exp(trainer - engine) (masking above "
                "--behav-imp-weight-cap); --use-tis would weight it a second time: give one of them"
            )

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @property
    def needs_ref(self) -> bool:
        """Whether reference log-probs must be computed."""
        uses_kl_reward = self.uses_kl_reward
        return self.loss_type == "policy_loss" and (self.use_kl_loss or uses_kl_reward)

    @property
    def uses_kl_reward(self) -> bool:
        """--kl-coef shapes the token rewards (the REINFORCE++ family and PPO)."""
        family = (
            self.advantage_estimator.startswith("reinforce_plus_plus") or self.advantage_estimator == "ppo"
        )
        return family and self.kl_coef != 0

    @property
    def needs_rollout_log_probs(self) -> bool:
        return self.loss_type == "policy_loss" and (
            self.use_tis or self.use_rollout_logprobs or self.use_decoupled_loss or self.get_mismatch_metrics
        )
