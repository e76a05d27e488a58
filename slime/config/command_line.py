"""The command line's own rules, before any record is built: each flag's value on its own (a
size >= 1, a range, a template, an address), and the flags given without the flag they work with.
The second kind reads the namespace because a record cannot tell a flag left out from one given
its default. The rules between settings read the records (slime.config.checks).

Each function returns the problems it found, one message each naming the flag and the fix."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from slime.config.debug import parse_push_fault
from slime.utils.files import template_problem

SIZES = (
    "actor_num_nodes",
    "actor_num_gpus_per_node",
    "rollout_num_gpus",
    "rollout_num_gpus_per_engine",
    "n_samples_per_prompt",
    "rollout_batch_size",
    "num_rollout",
    "num_epoch",
    "save_interval",
    "eval_interval",
    "update_weight_buffer_size",
    "rollout_max_response_len",
    "over_sampling_batch_size",
    "n_samples_per_eval_prompt",
    "eval_max_response_len",
)
HEALTH_CHECKS = ("interval", "timeout", "first_wait")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def size_problem(ns: argparse.Namespace) -> str | None:
    """The first size below 1 (the rules after it divide by the sizes)."""
    for name in SIZES:
        value = getattr(ns, name)
        if value is not None and value < 1:
            return f"{_flag(name)} must be >= 1 (got {value})"
    return None


def command_line_problems(ns: argparse.Namespace) -> list[str]:
    """Every flag's own value, then the flags given without the one they need."""
    return [*_values(ns), *_orphans(ns)]


def _values(ns: argparse.Namespace) -> Iterator[str]:
    for dest in ("save_debug_rollout_data", "save_debug_eval_data", "load_debug_rollout_data"):
        template = getattr(ns, dest)
        problem = template_problem(template, _flag(dest)) if template is not None else None
        if problem:
            yield problem
    r = ns.load_debug_rollout_data_subsample
    if r is not None and not 0 < r <= 1:
        yield f"--load-debug-rollout-data-subsample must be in (0, 1], got {r}"
    for dest in ("precision_logprob_tol", "precision_logprob_max_tol", "hang_timeout"):
        value = getattr(ns, dest)
        if value is not None and not value > 0:
            yield f"{_flag(dest)} must be > 0, got {value}"
    if ns.debug_push_fault is not None:
        try:
            parse_push_fault(ns.debug_push_fault)
        except ValueError as e:
            yield str(e)
    for name in ("interval", "timeout"):
        value = getattr(ns, f"rollout_health_check_{name}")
        if value is not None and not value > 0:
            yield f"--rollout-health-check-{name} must be > 0, got {value}"
    wait = ns.rollout_health_check_first_wait
    if wait is not None and wait < 0:
        yield f"--rollout-health-check-first-wait must be >= 0, got {wait}"
    yield from _external_addrs(ns)
    from slime.utils.mask_utils import SUPPORTED

    if ns.loss_mask_type not in SUPPORTED:
        yield (
            f"--loss-mask-type {ns.loss_mask_type} is not supported here: its chat templates rewrite "
            f"earlier turns, which the mask generator does not follow; use one of {', '.join(SUPPORTED)}"
        )
    lag = ns.max_policy_version_lag
    if lag is not None and lag < 0:
        yield f"--max-policy-version-lag must be >= 0 (got {lag})"
    if ns.update_weights_interval < 1:
        yield f"--update-weights-interval must be >= 1 (got {ns.update_weights_interval})"
    if ns.start_rollout_id is not None and ns.start_rollout_id < 0:
        yield f"--start-rollout-id must be >= 0 (got {ns.start_rollout_id})"


def _external_addrs(ns: argparse.Namespace) -> Iterator[str]:
    """--rollout-external-engine-addrs: HOST:PORT each, written http://HOST:PORT once valid."""
    addrs = ns.rollout_external_engine_addrs
    if addrs is None:
        return
    normalized = []
    for addr in addrs:
        hostport = addr.removeprefix("http://").rstrip("/")
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            yield f"--rollout-external-engine-addrs {addr!r}: expected HOST:PORT (e.g. 10.0.0.5:30000)"
            return
        normalized.append(f"http://{hostport}")
    if len(set(normalized)) != len(normalized):
        yield "--rollout-external-engine-addrs names an engine twice"
        return
    ns.rollout_external_engine_addrs = normalized


def _orphans(ns: argparse.Namespace) -> Iterator[str]:
    """A flag given without the flag it works with, which would otherwise change nothing."""
    if ns.load_debug_rollout_data is None and ns.load_debug_rollout_data_subsample is not None:
        yield "--load-debug-rollout-data-subsample needs --load-debug-rollout-data"
    given = [f for f in HEALTH_CHECKS if getattr(ns, f"rollout_health_check_{f}") is not None]
    if given and not ns.use_fault_tolerance:
        flag = _flag(f"rollout_health_check_{given[0]}")
        yield (
            f"{flag} sets the engine health checks, which run only with --use-fault-tolerance: add "
            f"it (or drop {flag})"
        )
    lag = ns.max_policy_version_lag
    if not ns.fully_async:
        for on, flag in (
            (lag is not None, "--max-policy-version-lag"),
            (ns.stale_group_action, "--stale-group-action"),
            (ns.pause_generation_mode, "--pause-generation-mode"),
        ):
            if on:
                yield (
                    f"{flag} applies to the continuous schedule only (train.py is synchronous, "
                    f"train_async.py one step off: their lag is 0 and 1): add --fully-async or drop {flag}"
                )
                break
    if ns.eval_min_new_tokens is not None and not (ns.eval_prompt_data or ns.eval_config):
        yield (
            "--eval-min-new-tokens applies to evaluation requests: give --eval-prompt-data or "
            "--eval-config (or drop it)"
        )
    if ns.stale_group_action and lag is None:
        yield "--stale-group-action says what happens beyond --max-policy-version-lag: give the bound too"
