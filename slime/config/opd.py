"""On-policy distillation (slime's --use-opd): a teacher scores the student's own samples, and each
response token's advantage loses `--opd-kl-coef * (log p_student - log p_teacher)`, whatever the
advantage estimator (slime.algo.advantages.opd_penalty).

Where the teacher's log-probs come from (`--opd-type`):

- `sglang`: an inference engine scores prompt + response during the rollout (no generation);
  the log-probs travel on the sample (`teacher_log_probs`) and in the rollout dumps. The engine
  is one the job starts from `--opd-teacher-load` (ours: slime expects a server it does not
  start), or one already running at `--opd-teacher-url` (ours), or slime's recipe: the teacher
  at `--rm-url` reached by `--custom-rm-path slime.rollout.on_policy_distillation.reward_func`
  and its post-process function. Any architecture; the tokenizer must be the student's.
- `megatron`: the teacher's weights (`--opd-teacher-load`, a Hugging Face directory of the
  student's architecture) sit in the train backend beside the reference weights, and its
  log-probs are computed in the train pass. Both train backends (FSDP and Megatron) do this.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from slime.config.flags import add_flags, flag, from_flags

OPD_TYPES = ("sglang", "megatron")
SLIME_RECIPE = "slime.rollout.on_policy_distillation"
OTHER_ARCHITECTURE = "a teacher of another architecture goes with --opd-type sglang"


@dataclass(frozen=True)
class OPDConfig:
    enabled: bool = flag("--use-opd", False)
    """distil from a teacher on the student's samples: the per-token reverse KL log p_student - log
    p_teacher, times --opd-kl-coef, comes off every advantage"""
    type: str | None = flag("--opd-type", None, choices=OPD_TYPES)
    """sglang: a teacher engine scores each sample during the rollout; megatron: the train backend
    (FSDP or Megatron) holds the teacher's weights and scores in the train pass"""
    kl_coef: float = flag("--opd-kl-coef", 1.0, unset=None, type=float)
    """the reverse KL's weight (default 1.0, slime's)"""
    teacher_load: str | None = flag("--opd-teacher-load", None)
    """the teacher's Hugging Face directory: --opd-type megatron loads it into the train ranks (the
    student's architecture); --opd-type sglang starts an engine on it (any architecture, the
    student's tokenizer)"""
    teacher_url: str | None = flag("--opd-teacher-url", None)
    """(ours) --opd-type sglang: the URL of a running SGLang-protocol engine serving the teacher"""

    @property
    def teacher_engine(self) -> bool:
        """Whether the job starts a teacher engine (--opd-type sglang with --opd-teacher-load)."""
        return self.enabled and self.type == "sglang" and self.teacher_load is not None

    @property
    def scores_in_rollout(self) -> bool:
        """Whether the rollout asks an engine of ours for teacher log-probs."""
        return self.enabled and self.type == "sglang" and (self.teacher_load or self.teacher_url) is not None

    @property
    def on_samples(self) -> bool:
        """Whether the teacher's log-probs come on the samples (--opd-type sglang: from the
        teacher engine, a user function or a replayed dump)."""
        return self.enabled and self.type == "sglang"

    @property
    def in_train(self) -> bool:
        """Whether the train ranks hold the teacher's weights (--opd-type megatron)."""
        return self.enabled and self.type == "megatron"


def add_opd_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, OPDConfig, "on-policy distillation (slime's --use-opd)")


def opd_config(ns: argparse.Namespace) -> OPDConfig:
    """The OPD settings of parsed flags; ValueError names the flag on bad input."""
    given = [
        f
        for f, v in (
            ("--opd-type", ns.opd_type),
            ("--opd-kl-coef", ns.opd_kl_coef),
            ("--opd-teacher-load", ns.opd_teacher_load),
            ("--opd-teacher-url", ns.opd_teacher_url),
        )
        if v is not None
    ]
    if not ns.use_opd:
        if given:
            raise ValueError(f"{given[0]} sets on-policy distillation: add --use-opd (or drop the flag)")
        return OPDConfig()
    if ns.opd_type is None:
        raise ValueError(
            "--use-opd needs --opd-type sglang (a teacher engine) or megatron (the train backend)"
        )
    kl_coef = 1.0 if ns.opd_kl_coef is None else ns.opd_kl_coef
    if not kl_coef >= 0:
        raise ValueError(f"--opd-kl-coef must be >= 0, got {ns.opd_kl_coef}")
    if getattr(ns, "loss_type", "policy_loss") != "policy_loss":
        raise ValueError(f"--use-opd changes the advantages: --loss-type {ns.loss_type} has none")
    if ns.opd_type == "megatron":
        if ns.opd_teacher_url is not None:
            raise ValueError(
                "--opd-teacher-url names a teacher engine: it goes with --opd-type sglang, not megatron"
            )
        if ns.opd_teacher_load is None:
            raise ValueError(
                "--opd-type megatron needs --opd-teacher-load: the teacher's Hugging Face directory"
            )
    elif ns.opd_teacher_load is not None and ns.opd_teacher_url is not None:
        raise ValueError(
            "--opd-teacher-load starts a teacher engine and --opd-teacher-url names a running one: give "
            "one of them"
        )
    elif getattr(ns, "multimodal_keys", None) and (ns.opd_teacher_load or ns.opd_teacher_url):
        raise ValueError(
            "--opd-type sglang with --multimodal-keys is not built: the teacher engine scores "
            "input-token log-probs, which the engines do not give for prompts with images; use "
            "--opd-type megatron (the teacher's weights in the train pass)"
        )
    elif ns.opd_teacher_load is None and ns.opd_teacher_url is None and not _own_functions(ns):
        raise ValueError(
            "--opd-type sglang needs a teacher: --opd-teacher-load DIR (the job starts an engine on it), "
            "--opd-teacher-url URL (a running engine), or slime's recipe (--custom-rm-path "
            f"{SLIME_RECIPE}.reward_func --custom-reward-post-process-path "
            f"{SLIME_RECIPE}.post_process_rewards --rm-url URL)"
        )
    return from_flags(OPDConfig, ns)


def _own_functions(ns: argparse.Namespace) -> bool:
    """User functions that may set `teacher_log_probs` themselves (slime's recipe is one)."""
    return any(
        getattr(ns, name, None)
        for name in (
            "custom_rm_path",
            "custom_reward_post_process_path",
            "rollout_function_path",
            "custom_generate_function_path",
        )
    )
