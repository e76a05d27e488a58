"""`--check-precision`: the step-0 gates of the debugging guide, as a pass/fail report.

At the first rollout of a fresh run the trainer's log-probs are computed from the same weights
as the reference's and as the engines' (they loaded, or were pushed, the same checkpoint), and
one optimizer step follows a log-prob pass over the same micro-batches. So, on a correct setup:

    actor log-probs == reference log-probs, bitwise      (KL is exactly 0)
    ppo_kl == 0 and kl_loss == 0 on the first optimizer step
    |trainer log-prob - engine log-prob| small             (mean and max, by dtype)
    log-probs finite and < 0, grad_norm finite

`gates` turns the trainer's measurements into `Check`s; `report` is the failure message, with
the guide's likely causes; `summary` the one line logged when every check passes. Nothing here
touches torch or Ray: the measurements come from the train actor (TrainOutput.precision).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class PrecisionError(RuntimeError):
    """A failed gate; the message is the whole report."""


@dataclass(frozen=True)
class Context:
    """What the gates need to know about the run besides the measurements."""

    rollout_id: int
    first: bool
    """The first rollout of this run: the engines hold the trainer's weights (loaded or pushed)."""
    mean_tol: float
    max_tol: float
    dtype: str
    """The lower precision of the engines and the trainer (what the tolerances are for)."""
    trainer_temperature: float
    sample_temperature: float | None = None
    """The temperature the samples' log-probs were computed at, when known (a dump's flags)."""
    ref_load: str | None = None
    """--ref-load when it names another checkpoint than --hf-checkpoint."""
    separate_log_prob_batches: bool = False
    """--log-probs-max-tokens-per-gpu packs the log-prob pass differently from training."""
    replay: bool = False
    resumed: bool = False
    """Resumed from --load: the actor has trained, so it no longer equals the reference."""
    lora_adapter: str | None = None
    """--lora-adapter-path: the adapters start trained, and the reference is the base model."""


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool | None
    """None: not applicable to this run (`detail` says why)."""
    value: str
    tolerance: str = ""
    detail: str = ""
    causes: tuple[str, ...] = ()
    short: str = ""
    """The check's result in the one-line summary of a passing run."""


_WEIGHTS_CAUSES = (
    "the engines do not hold the trainer's weights: --hf-checkpoint did not load on one side, or the "
    "weight push dropped, transposed or misnamed a tensor (the push before the first rollout runs with "
    '--check-precision; see docs/debugging.md "Parameter sync")',
    "the tokens the trainer scores are not the ones the engine sampled: a chat template or tokenization "
    "mismatch (--apply-chat-template, a custom generate function that re-tokenizes text)",
)
_KERNEL_CAUSE = (
    "non-deterministic kernels: the same weights on the same micro-batches give other bits when a kernel "
    "changes its reduction order between calls (atomics in attention or matmul; Transformer Engine's "
    "fused attention under context parallelism needs --attention-backend flash; MoE needs "
    "--moe-permute-fusion); try --deterministic-mode"
)


def _fmt(x: float) -> str:
    return f"{x:.3e}" if x and (abs(x) < 1e-3 or abs(x) >= 1e4) else f"{x:.6g}"


def gates(
    ctx: Context, rollout: dict[str, float], precision: dict[str, float], first_step: dict[str, float]
) -> list[Check]:
    """The checks of one rollout. `rollout`: the trainer's token means (TrainOutput.rollout);
    `precision`: its extra measurements (TrainOutput.precision); `first_step`: the metrics of
    the rollout's first optimizer step. Later rollouts only re-check ppo_kl."""
    critic_only = bool(first_step) and all(k.startswith("critic-") for k in first_step)
    if critic_only:  # --num-critic-only-steps: the merged step is the critic's alone
        why = "a critic-only rollout (--num-critic-only-steps): the actor takes no step"
        checks = [Check("ppo_kl == 0 on the first optimizer step", None, "-", detail=why)]
    else:
        checks = [_ppo_kl(ctx, precision, first_step)]
    if "critic_first_step_max_abs_diff" in precision:
        checks.append(_critic_values(precision))
    if not ctx.first:
        return checks
    if ctx.resumed or ctx.lora_adapter:
        why = (
            "resumed from --load: the actor has trained away from the reference"
            if ctx.resumed
            else f"--lora-adapter-path {ctx.lora_adapter}: the adapters start trained, the reference is "
            "the base model"
        )
        checks += [
            Check("actor log-probs == reference log-probs (bitwise)", None, "-", detail=why),
            Check("kl_loss == 0 on the first optimizer step", None, "-", detail=why),
        ]
    else:
        kl = (
            Check("kl_loss == 0 on the first optimizer step", None, "-", detail=why)
            if critic_only
            else _kl_loss(ctx, first_step)
        )
        checks += [_actor_vs_ref(ctx, precision), kl]
    if "log_probs" in rollout:
        checks += [_engine_gap(ctx, rollout), _log_probs_valid(precision, rollout)]
    if not critic_only:
        checks.append(_grad_norm(first_step))
    if "critic-grad_norm" in first_step:
        checks.append(_grad_norm(first_step, "critic-"))
    return checks


def _ppo_kl(ctx: Context, precision: dict[str, float], step: dict[str, float]) -> Check:
    name = "ppo_kl == 0 on the first optimizer step"
    if "ppo_kl" not in step:
        return Check(name, None, "-", detail="no policy loss (--loss-type sft_loss)")
    diff = precision.get("first_step_max_abs_diff", 0.0)
    causes = [_KERNEL_CAUSE]
    if ctx.separate_log_prob_batches:
        causes.insert(
            0,
            "the log-prob pass packs other micro-batches than training (--log-probs-max-tokens-per-gpu "
            "differs from --max-tokens-per-gpu), and other padding gives other bits: drop the flag",
        )
    causes.append("dropout is active in training (attention_dropout / hidden_dropout > 0 in config.json)")
    return Check(
        name,
        step["ppo_kl"] == 0.0 and diff == 0.0,
        f"ppo_kl {_fmt(step['ppo_kl'])}, max |old - new log-prob| {_fmt(diff)}",
        "exactly 0",
        "the log-prob pass and the training forward disagree on the same weights",
        tuple(causes),
        "ppo_kl 0",
    )


_CRITIC_DROPOUT = (
    "dropout is active in training (--attention-dropout or --hidden-dropout; on FSDP also hidden_dropout "
    "> 0 in the critic's config.json)"
)


def _critic_values(precision: dict[str, float]) -> Check:
    """PPO's critic: its first step's values equal its value pass's (the old values) bitwise, so
    the clipped value loss starts from V = V_old."""
    diff = precision["critic_first_step_max_abs_diff"]
    return Check(
        "critic values == its value pass on the first optimizer step (bitwise)",
        diff == 0.0,
        f"max |old - new value| {_fmt(diff)}",
        "exactly 0",
        "the critic's value pass and its training forward disagree on the same weights",
        (_KERNEL_CAUSE, _CRITIC_DROPOUT),
        "critic values 0",
    )


def _actor_vs_ref(ctx: Context, precision: dict[str, float]) -> Check:
    name = "actor log-probs == reference log-probs (bitwise)"
    if "ref_max_abs_diff" not in precision:
        return Check(name, None, "-", detail="no reference model (--use-kl-loss or --kl-coef load one)")
    diff, count = precision["ref_max_abs_diff"], int(precision.get("ref_tokens_differ", 0))
    causes = [_KERNEL_CAUSE]
    if ctx.ref_load:
        causes.insert(0, f"--ref-load {ctx.ref_load} is another checkpoint than --hf-checkpoint")
    causes.append("the reference was loaded in another dtype or from a checkpoint saved differently")
    return Check(
        name,
        diff == 0.0,
        f"max |diff| {_fmt(diff)} over {count} differing tokens",
        "exactly 0",
        "KL is not 0 before any training",
        tuple(causes),
        "actor == reference bitwise",
    )


def _kl_loss(ctx: Context, step: dict[str, float]) -> Check:
    name = "kl_loss == 0 on the first optimizer step"
    if "kl_loss" not in step:
        return Check(name, None, "-", detail="no KL loss (--use-kl-loss)")
    causes = [_KERNEL_CAUSE]
    if ctx.ref_load:
        causes.insert(0, f"--ref-load {ctx.ref_load} is another checkpoint than --hf-checkpoint")
    return Check(
        name,
        step["kl_loss"] == 0.0,
        f"kl_loss {_fmt(step['kl_loss'])}",
        "exactly 0",
        "the actor moved away from the reference before its first update",
        tuple(causes),
        "kl_loss 0",
    )


def _engine_gap(ctx: Context, rollout: dict[str, float]) -> Check:
    name = "trainer vs engine log-probs (mean and max |diff|)"
    if "train_rollout_logprob_abs_diff" not in rollout:
        why = "the samples carry no engine log-probs (a rollout function that does not return them)"
        return Check(name, None, "-", detail=why)
    causes = list(_WEIGHTS_CAUSES)
    if ctx.replay:
        causes[0] = (
            "the replayed dump was generated with other weights than --hf-checkpoint (its engine log-probs "
            "are those of the model that generated it: replay with that checkpoint)"
        )
    if ctx.sample_temperature is not None and ctx.sample_temperature != ctx.trainer_temperature:
        causes.insert(
            0,
            f"temperature: the samples' log-probs are at temperature {ctx.sample_temperature:g}, the trainer "
            f"computes at --rollout-temperature {ctx.trainer_temperature:g}; use the same value",
        )
    else:
        causes.append(
            "temperature: the trainer computes log-probs at --rollout-temperature "
            f"{ctx.trainer_temperature:g}; the engine must sample (and report log-probs) at the same one"
        )
    causes.append(
        f"precision: the tolerances are for {ctx.dtype}; if the gap is expected, raise "
        "--precision-logprob-tol / --precision-logprob-max-tol"
    )
    causes.append(
        "per sample and token: save the rollout (--save-debug-rollout-data) and run "
        "python -m slime.tools.check_logprob_precision on it"
    )
    mean, worst = rollout["train_rollout_logprob_abs_diff"], rollout["train_rollout_logprob_abs_diff_max"]
    return Check(
        name,
        mean <= ctx.mean_tol and worst <= ctx.max_tol,
        f"mean {_fmt(mean)}, max {_fmt(worst)}",
        f"mean <= {ctx.mean_tol:g} (--precision-logprob-tol), max <= {ctx.max_tol:g} "
        "(--precision-logprob-max-tol)",
        "the trainer and the engines disagree on the tokens the engines sampled",
        tuple(causes),
        f"|trainer - engine| mean {_fmt(mean)} max {_fmt(worst)} (tol {ctx.mean_tol:g} / {ctx.max_tol:g})",
    )


def _log_probs_valid(precision: dict[str, float], rollout: dict[str, float]) -> Check:
    bad, top, mean = (
        int(precision.get("nonfinite", 0)),
        precision.get("max_log_prob", -1.0),
        rollout["log_probs"],
    )
    ok = bad == 0 and top <= 0.0 and mean < 0.0
    return Check(
        "log-probs finite and < 0",
        ok,
        f"{bad} non-finite, max {_fmt(top)}, mean {_fmt(mean)}",
        "finite, every token <= 0, mean < 0",
        "the trainer's log-probs are not log-probabilities",
        (
            "NaN/Inf weights or activations: a checkpoint that did not load (uninitialised memory) or "
            "float16 overflow (train in bfloat16 or float32)",
            "a positive value: a log-softmax bug in a custom model or logits processor",
        ),
        f"log-probs finite (max {_fmt(top)}, mean {_fmt(mean)})",
    )


def _grad_norm(step: dict[str, float], prefix: str = "") -> Check:
    """The first step's gradient norm (`prefix` "critic-": PPO's critic's)."""
    norm = step.get(f"{prefix}grad_norm", float("nan"))
    return Check(
        f"{prefix}grad_norm finite",
        math.isfinite(norm),
        _fmt(norm),
        "finite",
        "the first optimizer step produced NaN/Inf gradients",
        (
            "a NaN or infinite reward or advantage (check the reward function)",
            "float16 without loss scaling; a learning rate or loss configuration that diverges",
        ),
        f"{prefix}grad_norm {_fmt(norm)}",
    )


def failed(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.ok is False]


def report(ctx: Context, checks: list[Check]) -> str:
    """The failure report: every check with its state, then each failure's likely causes."""
    bad = failed(checks)
    ran = sum(c.ok is not None for c in checks)
    lines = [f"--check-precision: {len(bad)} of {ran} checks FAILED at rollout {ctx.rollout_id}"]
    for c in checks:
        state = "FAIL" if c.ok is False else "ok  " if c.ok else "skip"
        tol = f"  (want {c.tolerance})" if c.tolerance and c.ok is not None else ""
        lines.append(f"  {state} {c.name}: {c.value}{tol}" + (f"  [{c.detail}]" if c.ok is None else ""))
    for c in bad:
        lines.append(f"{c.name}: {c.detail}. Likely causes:")
        lines += [f"  - {cause}" for cause in c.causes]
    lines.append('See docs/debugging.md "Precision".')
    return "\n".join(lines)


def summary(ctx: Context, checks: list[Check]) -> str:
    """One line for a passing run."""
    ran = [c.short for c in checks if c.ok]
    skipped = [c.name.split(" (")[0] for c in checks if c.ok is None]
    line = f"--check-precision: passed at rollout {ctx.rollout_id}: {', '.join(ran)}"
    if skipped:
        line += f" (not applicable: {'; '.join(skipped)})"
    return line
