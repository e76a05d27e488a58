"""--check-precision's gates on measurements, and --debug-push-fault's faults on buckets."""

from __future__ import annotations

import math

import pytest
import torch

from slime.bridge.faults import PushFault
from slime.debug import precision as p
from slime.ray.cli import parse_args

GOOD_ROLLOUT = {
    "log_probs": -4.6,
    "ref_log_probs": -4.6,
    "kl": 0.0,
    "rollout_log_probs": -4.6,
    "train_rollout_logprob_abs_diff": 1e-7,
    "train_rollout_logprob_abs_diff_max": 5e-7,
}
GOOD_PRECISION = {
    "nonfinite": 0.0,
    "max_log_prob": -4.1,
    "ref_max_abs_diff": 0.0,
    "ref_tokens_differ": 0.0,
    "first_step_max_abs_diff": 0.0,
}
GOOD_STEP = {"ppo_kl": 0.0, "kl_loss": 0.0, "grad_norm": 0.09, "pg_loss": 0.0}


def ctx(**kw):
    base = dict(
        rollout_id=0, first=True, mean_tol=1e-4, max_tol=1e-3, dtype="float32", trainer_temperature=1.0
    )
    return p.Context(**{**base, **kw})


def run(context=None, rollout=None, precision=None, step=None):
    context = context or ctx()
    checks = p.gates(
        context,
        {**GOOD_ROLLOUT, **(rollout or {})},
        {**GOOD_PRECISION, **(precision or {})},
        {**GOOD_STEP, **(step or {})},
    )
    return checks, p.report(context, checks)


def test_a_correct_setup_passes_with_one_summary_line():
    checks, _ = run()
    assert len(checks) == 6 and all(c.ok for c in checks)
    line = p.summary(ctx(), checks)
    assert "\n" not in line and line.startswith("--check-precision: passed at rollout 0")
    assert "actor == reference bitwise" in line and "mean 1.000e-07 max 5.000e-07" in line


@pytest.mark.parametrize(
    "change, failing, message, cause",
    [
        (
            {"precision": {"ref_max_abs_diff": 3e-8, "ref_tokens_differ": 2}},
            "actor log-probs == reference",
            "max |diff| 3.000e-08 over 2 differing tokens",
            "non-deterministic kernels",
        ),
        (
            {"step": {"ppo_kl": 1e-9}, "precision": {"first_step_max_abs_diff": 2e-7}},
            "ppo_kl == 0",
            "ppo_kl 1.000e-09, max |old - new log-prob| 2.000e-07",
            "dropout is active",
        ),
        ({"step": {"kl_loss": 0.25}}, "kl_loss == 0", "kl_loss 0.25", "non-deterministic kernels"),
        (
            {"rollout": {"train_rollout_logprob_abs_diff": 0.08}},
            "trainer vs engine",
            "mean 0.08, max 5.000e-07",
            "the engines do not hold the trainer's weights",
        ),
        (
            {"rollout": {"train_rollout_logprob_abs_diff_max": 0.3}},
            "trainer vs engine",
            "max 0.3",
            "chat template or tokenization mismatch",
        ),
        ({"precision": {"nonfinite": 3}}, "log-probs finite", "3 non-finite", "did not load"),
        ({"precision": {"max_log_prob": 0.5}}, "log-probs finite", "max 0.5", "log-softmax bug"),
        ({"step": {"grad_norm": float("nan")}}, "grad_norm finite", "nan", "NaN or infinite reward"),
    ],
)
def test_each_gate_fails_alone_with_its_value_and_causes(change, failing, message, cause):
    checks, report = run(**change)
    bad = p.failed(checks)
    assert [c.name for c in bad] == [c.name for c in checks if c.name.startswith(failing)] and len(bad) == 1
    assert f"1 of {len(checks)} checks FAILED at rollout 0" in report
    assert message in report and cause in report
    assert f"  FAIL {bad[0].name}" in report and 'docs/debugging.md "Precision"' in report


def test_the_report_names_the_flag_that_explains_a_failure():
    _, report = run(ctx(ref_load="/models/other"), precision={"ref_max_abs_diff": 0.1})
    assert "--ref-load /models/other is another checkpoint than --hf-checkpoint" in report
    _, report = run(
        ctx(sample_temperature=1.0, trainer_temperature=0.7), rollout={"train_rollout_logprob_abs_diff": 0.2}
    )
    assert (
        "the samples' log-probs are at temperature 1, the trainer computes at --rollout-temperature 0.7"
        in report
    )
    _, report = run(ctx(separate_log_prob_batches=True), step={"ppo_kl": 1e-6})
    assert "--log-probs-max-tokens-per-gpu" in report
    _, report = run(
        ctx(dtype="bfloat16", mean_tol=0.05, max_tol=2.0), rollout={"train_rollout_logprob_abs_diff": 0.2}
    )
    assert (
        "the tolerances are for bfloat16" in report
        and "(want mean <= 0.05 (--precision-logprob-tol)" in report
    )


def test_checks_that_do_not_apply_are_skipped_and_said_so():
    context = ctx()
    checks = p.gates(
        context,
        {"log_probs": -1.0},
        {"nonfinite": 0.0, "max_log_prob": -0.5},
        {"ppo_kl": 0.0, "grad_norm": 1.0},
    )
    skipped = {c.name: c.detail for c in checks if c.ok is None}
    assert set(skipped) == {
        "actor log-probs == reference log-probs (bitwise)",
        "kl_loss == 0 on the first optimizer step",
        "trainer vs engine log-probs (mean and max |diff|)",
    }
    assert "no reference model" in skipped["actor log-probs == reference log-probs (bitwise)"]
    assert "not applicable: actor log-probs == reference log-probs" in p.summary(context, checks)
    # sft_loss: no log-prob pass, no ppo_kl.
    checks = p.gates(context, {}, {}, {"loss": 1.0, "grad_norm": 1.0})
    assert [c.ok for c in checks] == [None, None, None, True]


def test_a_resumed_run_skips_only_what_needs_actor_equal_to_reference():
    checks, _ = run(ctx(resumed=True), precision={"ref_max_abs_diff": 0.3}, step={"kl_loss": 0.01})
    assert not p.failed(checks)
    skipped = [c for c in checks if c.ok is None]
    assert len(skipped) == 2 and all("resumed from --load" in c.detail for c in skipped)
    checks, _ = run(ctx(resumed=True), rollout={"train_rollout_logprob_abs_diff": 0.2})
    assert [c.name for c in p.failed(checks)] == ["trainer vs engine log-probs (mean and max |diff|)"]


def test_a_run_from_a_trained_lora_adapter_skips_the_actor_equals_reference_checks():
    """--lora-adapter-path: the adapters start trained and the reference is the base model."""
    checks, _ = run(ctx(lora_adapter="/a"), precision={"ref_max_abs_diff": 0.3}, step={"kl_loss": 0.01})
    assert not p.failed(checks)
    skipped = [c for c in checks if c.ok is None]
    assert len(skipped) == 2 and all("--lora-adapter-path /a" in c.detail for c in skipped)


def test_later_rollouts_check_only_ppo_kl():
    checks = p.gates(
        ctx(rollout_id=3, first=False), {"log_probs": 1.0}, {"first_step_max_abs_diff": 0.0}, GOOD_STEP
    )
    assert [c.name for c in checks] == ["ppo_kl == 0 on the first optimizer step"] and checks[0].ok


def test_the_critics_first_step_is_checked_on_every_rollout():
    """PPO: the critic's first step's values against its value pass, bitwise, like ppo_kl."""
    for first in (True, False):
        checks = p.gates(
            ctx(rollout_id=0 if first else 3, first=first),
            GOOD_ROLLOUT,
            {**GOOD_PRECISION, "critic_first_step_max_abs_diff": 0.0},
            GOOD_STEP,
        )
        critic = [c for c in checks if c.name.startswith("critic values")]
        assert len(critic) == 1 and critic[0].ok
    checks, report = run(precision={"critic_first_step_max_abs_diff": 3e-7})
    assert [c.name for c in p.failed(checks)] == [
        "critic values == its value pass on the first optimizer step (bitwise)"
    ]
    assert "max |old - new value| 3.000e-07" in report and "dropout is active in training" in report


def test_a_critic_only_rollout_skips_the_actors_step_checks_and_checks_the_critics():
    """--num-critic-only-steps: the actor takes no step; its step checks say so, the critic's
    gradient norm is checked instead."""
    step = {"critic-value_loss": 0.5, "critic-grad_norm": 0.3}
    checks = p.gates(ctx(), GOOD_ROLLOUT, {**GOOD_PRECISION, "critic_first_step_max_abs_diff": 0.0}, step)
    skipped = {c.name: c.detail for c in checks if c.ok is None}
    assert set(skipped) == {
        "ppo_kl == 0 on the first optimizer step",
        "kl_loss == 0 on the first optimizer step",
    }
    assert all("critic-only rollout" in d for d in skipped.values())
    assert not p.failed(checks) and "critic-grad_norm finite" in [c.name for c in checks]
    assert "grad_norm finite" not in [c.name for c in checks]
    bad = p.gates(ctx(), GOOD_ROLLOUT, GOOD_PRECISION, {**step, "critic-grad_norm": float("inf")})
    assert [c.name for c in p.failed(bad)] == ["critic-grad_norm finite"]


def test_nan_measurements_fail():
    checks, _ = run(
        precision={"ref_max_abs_diff": math.nan}, rollout={"train_rollout_logprob_abs_diff": math.nan}
    )
    assert {c.name.split(" ")[0] for c in p.failed(checks)} == {"actor", "trainer"}


def test_flags_choose_tolerances_by_dtype_and_refuse_bad_combinations(tiny_model, tmp_path, capsys):
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
    ]
    d = parse_args([*base, "--check-precision"]).debug
    assert (d.check_precision, d.precision_dtype, d.precision_logprob_tol, d.precision_logprob_max_tol) == (
        True,
        "float32",
        1e-4,
        1e-3,
    )
    d = parse_args([*base, "--fsdp-param-dtype", "bfloat16", "--precision-logprob-max-tol", "3"]).debug
    assert (d.precision_dtype, d.precision_logprob_tol, d.precision_logprob_max_tol) == (
        "bfloat16",
        5e-2,
        3.0,
    )
    for extra, message in [
        (["--check-precision", "--debug-rollout-only"], "--debug-rollout-only starts no trainer"),
        (["--precision-logprob-tol", "0"], "--precision-logprob-tol must be > 0"),
        (["--debug-push-fault", "scale:x"], "--debug-push-fault 'scale:x': expected KIND:NAME"),
        (["--debug-push-fault", "swap:a"], "swap:NAME1,NAME2"),
        (["--debug-push-fault", "drop:a", "--debug-rollout-only"], "never run"),
        (["--check-weight-sync", "--debug-rollout-only"], "--check-weight-sync checks the weight push"),
        (["--check-weight-update-equal", "--load-debug-rollout-data", "d_{rollout_id}.pt"], "never run"),
    ]:
        with pytest.raises(SystemExit) as e:
            parse_args([*base, *extra])
        assert e.value.code == 2 and message in capsys.readouterr().err, extra


# ---- --debug-push-fault ------------------------------------------------------------------------
def buckets():
    torch.manual_seed(0)
    named = [
        ("a", torch.randn(3, 3)),
        ("b", torch.randn(3, 3)),
        ("c", torch.randn(4)),
        ("d", torch.randn(2, 5)),
    ]
    return [named[:2], named[2:]]


def flat(bs):
    return dict(pair for b in bs for pair in b)


@pytest.mark.parametrize("spec", ["perturb:a", "noise:c", "transpose:d", "drop:b", "swap:a,b"])
def test_each_fault_changes_only_its_tensors_and_never_the_source(spec):
    source = buckets()
    before = {n: t.clone() for n, t in flat(source).items()}
    fault = PushFault.parse(spec)
    out = flat(fault.apply(iter(source), bucket_bytes=1 << 20))
    assert all(torch.equal(t, before[n]) for n, t in flat(source).items())  # copies only
    changed = {n for n in before if n not in out or not torch.equal(out[n], before[n])}
    assert changed == set(fault.names)
    if fault.kind == "perturb":
        assert (out["a"] - before["a"]).flatten().tolist() == [1.0] + [0.0] * 8
    elif fault.kind == "transpose":
        assert torch.equal(out["d"], before["d"].t())
    elif fault.kind == "swap":
        assert torch.equal(out["a"], before["b"]) and torch.equal(out["b"], before["a"])
    elif fault.kind == "noise":
        assert (out["c"] != before["c"]).all()


def test_fault_check_runs_before_any_push():
    shapes = {n: tuple(t.shape) for n, t in flat(buckets()).items()}
    PushFault.parse("swap:a,b").check(shapes)
    for spec, message in [
        ("drop:zz", "no parameter named 'zz'; some that exist: a, b, c, d"),
        ("transpose:c", "not a matrix"),
        ("swap:a,d", "shapes (3, 3) and (2, 5) differ"),
    ]:
        with pytest.raises(ValueError, match="--debug-push-fault") as e:
            PushFault.parse(spec).check(shapes)
        assert message in str(e.value)
