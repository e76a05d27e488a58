"""The debug modes' and checks' flags (docs/debugging.md): their record, the precision
tolerances and --debug-push-fault's grammar. Their rules: slime.config.command_line (each flag's
own value) and slime.config.checks (against the other settings)."""

from __future__ import annotations

from dataclasses import dataclass

from slime.config.flags import flag


@dataclass(frozen=True)
class DebugConfig:
    """The decoupled debug modes (docs/debugging.md)."""

    rollout_only: bool = flag("--debug-rollout-only", False)
    """start only the engines and the rollout manager; weights stay --hf-checkpoint's"""
    train_only: bool = flag("--debug-train-only", False)
    """start only the trainer; rollouts come from --load-debug-rollout-data or a
    --rollout-function-path"""
    save_rollout_data: str | None = flag("--save-debug-rollout-data", None, metavar="TEMPLATE")
    """write every rollout to TEMPLATE.format(rollout_id=...), e.g. dumps/rollout_{rollout_id}.pt"""
    save_eval_data: str | None = flag("--save-debug-eval-data", None, metavar="TEMPLATE")
    """write every eval rollout to this template ({rollout_id}; -1 = before training)"""
    dump_details: str | None = flag("--dump-details", None, metavar="DIR")
    """every rollout, evaluation and train-data dump under DIR in slime's layout (rollout_data/,
    train_data/) and the tokenizer in DIR/tokenizer, for post-hoc analysis"""
    load_rollout_data: str | None = flag("--load-debug-rollout-data", None, metavar="TEMPLATE")
    """train on saved rollouts instead of generating (implies --debug-train-only)"""
    subsample: float = 1.0
    """`--load-debug-rollout-data-subsample R`: the fraction of prompt groups replayed."""
    allow_tokenizer_mismatch: bool = flag("--allow-tokenizer-mismatch", False)
    """replay dumps whose tokenizer fingerprint differs from --hf-checkpoint's"""
    check_precision: bool = flag(
        "--check-precision", False, group="debug: precision checks (docs/debugging.md, Precision)"
    )
    """fail at the first rollout unless actor == reference bitwise, ppo_kl == kl_loss == 0, trainer
    and engine log-probs agree within the tolerances, log-probs and grad_norm are sane"""
    precision_dtype: str = "float32"
    """The lower precision of engines and trainer, which the tolerances below default for."""
    precision_logprob_tol: float = 1e-4
    """`--precision-logprob-tol`: largest mean |trainer - engine| log-prob at the first rollout."""
    precision_logprob_max_tol: float = 1e-3
    """`--precision-logprob-max-tol`: largest single-token |trainer - engine| log-prob."""
    push_fault: str | None = flag(
        "--debug-push-fault",
        None,
        group="debug: precision checks (docs/debugging.md, Precision)",
        metavar="SPEC",
    )
    """break every weight push on purpose to see the checks fail: perturb:NAME, noise:NAME,
    transpose:NAME, drop:NAME or swap:NAME1,NAME2 (HF parameter names)"""
    phase_hook: str | None = flag(
        "--debug-phase-hook",
        None,
        group="debug: precision checks (docs/debugging.md, Precision)",
        metavar="MODULE.FUNCTION",
    )
    """call FUNCTION(phase, info) at the named phases of every step, in the process that runs them
    (driver, rollout manager, train ranks): a deterministic moment for fault-injection tests
    (docs/debugging.md, Fault tolerance)"""
    sync_parameters_path: str | None = flag(
        "--debug-sync-parameters-path",
        None,
        group="debug: parameter sync (docs/debugging.md, Parameter sync)",
        metavar="DIR",
    )
    """(or DEBUG_SYNC_PARAMETERS_PATH) dump every engine's parameters to
    DIR/before_sync_parameter/<rank>/, push the trainer's weights once, dump to
    DIR/after_sync_parameter/<rank>/, exit; compare with python -m
    slime.tools.check_sync_parameter --root_dir DIR"""
    check_weight_sync: bool = flag(
        "--check-weight-sync", False, group="debug: parameter sync (docs/debugging.md, Parameter sync)"
    )
    """after every push, compare per-tensor fingerprints of what the trainer exported with what
    every engine holds; a difference stops the job (on with --check-precision)"""
    check_weight_update_equal: bool = flag(
        "--check-weight-update-equal",
        False,
        group="debug: parameter sync (docs/debugging.md, Parameter sync)",
    )
    """before the first rollout: engines snapshot their loaded weights, overwrite them with noise,
    receive the first push, and must equal the snapshot exactly"""
    ci_test: bool = flag("--ci-test", False, group="debug: slime's CI checks (slime.loop.ci_checks)")
    """end the job when slime's CI checks fail: KL exactly 0 at step 0, -1 < rollout/log_probs < 0,
    0 < rollout/entropy < 1, the trainer-engine log-prob gap under its threshold"""
    ci_disable_kl_checker: bool = flag(
        "--ci-disable-kl-checker", False, group="debug: slime's CI checks (slime.loop.ci_checks)"
    )
    """--ci-test without the step-0 KL checks"""
    ci_train_rollout_logprob_abs_diff_threshold: float = flag(
        "--ci-train-rollout-logprob-abs-diff-threshold",
        0.1,
        group="debug: slime's CI checks (slime.loop.ci_checks)",
    )
    """--ci-test's bound on rollout/train_rollout_logprob_abs_diff (0.1)"""
    ci_save_grad_norm: str | None = flag(
        "--ci-save-grad-norm",
        None,
        metavar="TEMPLATE",
        group="debug: slime's CI checks (slime.loop.ci_checks)",
    )
    """save every optimizer step's grad norm to TEMPLATE ({role}, {rollout_id}, {step_id})"""
    ci_load_grad_norm: str | None = flag(
        "--ci-load-grad-norm",
        None,
        metavar="TEMPLATE",
        group="debug: slime's CI checks (slime.loop.ci_checks)",
    )
    """end the job when a step's grad norm differs from the one saved there by more than 0.01
    (relative or absolute)"""
    hang_timeout: float | None = flag(
        "--hang-timeout",
        None,
        group="debug: hangs (docs/debugging.md, Hangs and breakpoints)",
        type=float,
        metavar="SECONDS",
    )
    """when a train step or weight push runs longer, every train rank writes its Python stacks (all
    threads) to <log dir>/hang/rank{r}.txt and the job exits 1"""
    trace_dir: str | None = flag(
        "--trace-dir",
        None,
        group="debug: the job's timeline (docs/observability.md, The job's timeline)",
        metavar="DIR",
    )
    """write a timeline of the whole job into DIR (trace-<date>-<time>-<pid>.json, Chrome's
    trace-event format: open it in Perfetto or chrome://tracing): a track per process with its
    phases, the engines' requests as counters; and end the job with a 'where the time went' table
    in the log"""


# (mean, max) |trainer - engine| log-prob tolerances by the lower precision of engine and
# trainer. float32: measured 1.4e-07 mean, 2.4e-06 max on the demo model (docs/debugging.md);
# bf16/fp16 are starting points for GPU runs, where slime users see ~1e-2 means.
TOLERANCES = {"float32": (1e-4, 1e-3), "bfloat16": (5e-2, 2.0), "float16": (2e-2, 1.0)}
_RANK = {"float32": 0, "float16": 1, "bfloat16": 2}


def lower_precision(*dtypes: str) -> str:
    return max(dtypes, key=lambda d: _RANK[d])


PUSH_FAULT_KINDS = ("perturb", "noise", "transpose", "drop", "swap")


def parse_push_fault(spec: str) -> tuple[str, tuple[str, ...]]:
    """--debug-push-fault's grammar (slime.bridge.faults applies it): `KIND:NAME` or
    `swap:NAME1,NAME2` -> (kind, names); ValueError names the flag and the forms."""
    kind, _, rest = spec.partition(":")
    names = tuple(n for n in rest.split(",") if n)
    want = 2 if kind == "swap" else 1
    if kind not in PUSH_FAULT_KINDS or len(names) != want:
        raise ValueError(
            f"--debug-push-fault {spec!r}: expected KIND:NAME with KIND one of "
            f"{', '.join(k for k in PUSH_FAULT_KINDS if k != 'swap')}, or swap:NAME1,NAME2 (HF parameter "
            "names)"
        )
    return kind, names
