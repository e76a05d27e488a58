"""slime's --ci-* checks, on each step's metrics in the driver: a check that fails ends the job
(exit 1) with the value and the bound.

    --ci-test                         the step-0 KL gates (train/ppo_kl, train/kl_loss, and
                                      |rollout/log_probs - rollout/ref_log_probs| at rollout 0:
                                      all below 1e-8, unless --ci-disable-kl-checker or R3), the
                                      ranges -1 < rollout/log_probs < 0 and 0 < rollout/entropy < 1,
                                      rollout/train_rollout_logprob_abs_diff at most
                                      --ci-train-rollout-logprob-abs-diff-threshold
    --ci-save-grad-norm TEMPLATE      every optimizer step's grad norm to TEMPLATE ({role},
                                      {rollout_id}, {step_id}), for a run in another layout to
    --ci-load-grad-norm TEMPLATE      compare against (relative or absolute 0.01, slime's tolerance)

slime runs these inside the trainer; here the trainer's step metrics come back to the driver, so
they are checked there, with the same values. slime's MTP-gradient and fault-injection checks are
not part of --ci-test here (MTP is checked by tests; faults by --debug-phase-hook).
"""

from __future__ import annotations

import math
import os
from typing import Any

from slime.loop.core import Hook, Loop
from slime.loop.parts import Step

KL_BOUND = 1e-8


class CIChecks(Hook):
    def __init__(self, debug: Any, routing_replay: bool):
        self.cfg = debug
        self.kl = debug.ci_test and not debug.ci_disable_kl_checker and not routing_replay

    def after_train(self, loop: Loop, step: Step) -> None:
        assert step.output is not None
        cfg, out = self.cfg, step.output
        if cfg.ci_test:
            self._check_rollout(step.rollout_id, out.rollout)
        for k, metrics in enumerate(out.steps):
            if self.kl and k == 0 and "pg_clipfrac" in metrics:
                bound("train/ppo_kl", metrics.get("ppo_kl", 0.0), KL_BOUND, step.rollout_id)
            if self.kl and step.rollout_id == 0 and k == 0 and "kl_loss" in metrics:  # the run's step 0
                bound("train/kl_loss", metrics["kl_loss"], KL_BOUND, step.rollout_id)
            self._grad_norm(step.rollout_id, k, metrics.get("grad_norm"))

    def _check_rollout(self, rollout_id: int, rollout: dict[str, float]) -> None:
        lp, ref = rollout.get("log_probs"), rollout.get("ref_log_probs")
        if self.kl and rollout_id == 0 and lp is not None and ref is not None:
            bound("|rollout/log_probs - rollout/ref_log_probs|", abs(lp - ref), KL_BOUND, rollout_id)
        if lp is not None and not -1 < lp < 0:
            raise CICheckFailed(
                f"--ci-test: rollout {rollout_id}: rollout/log_probs = {lp} is not in (-1, 0)"
            )
        entropy = rollout.get("entropy")
        if entropy is not None and not 0 < entropy < 1:
            raise CICheckFailed(
                f"--ci-test: rollout {rollout_id}: rollout/entropy = {entropy} is not in (0, 1)"
            )
        diff = rollout.get("train_rollout_logprob_abs_diff")
        if diff is not None:
            limit = self.cfg.ci_train_rollout_logprob_abs_diff_threshold
            if not diff <= limit:
                raise CICheckFailed(
                    f"--ci-test: rollout {rollout_id}: rollout/train_rollout_logprob_abs_diff = {diff} "
                    f"exceeds --ci-train-rollout-logprob-abs-diff-threshold {limit}"
                )

    def _grad_norm(self, rollout_id: int, step_id: int, value: float | None) -> None:
        template = self.cfg.ci_save_grad_norm or self.cfg.ci_load_grad_norm
        if template is None or value is None:
            return
        import torch

        path = template.format(role="actor", rollout_id=rollout_id, step_id=step_id)
        if self.cfg.ci_save_grad_norm:  # slime: saving wins when both are given
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            torch.save(float(value), path)
            return
        if not os.path.isfile(path):
            raise CICheckFailed(
                f"--ci-load-grad-norm: {path} does not exist (write it with --ci-save-grad-norm)"
            )
        expected = float(torch.load(path, weights_only=True))
        if not math.isclose(value, expected, rel_tol=0.01, abs_tol=0.01):
            raise CICheckFailed(
                f"--ci-load-grad-norm: rollout {rollout_id} step {step_id}: grad norm {value} against "
                f"{expected} saved in {path} (relative or absolute tolerance 0.01)"
            )


class CICheckFailed(RuntimeError):
    """A --ci-* check failed: the job ends."""


def bound(name: str, value: float, limit: float, rollout_id: int) -> None:
    if not abs(value) < limit:
        raise CICheckFailed(f"--ci-test: rollout {rollout_id}: {name} = {value} is not below {limit}")
