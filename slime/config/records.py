"""The typed configuration a job runs with, one record per component (slime.config.arguments
builds them from the command line)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from slime.config.critic import CriticConfig
from slime.config.eval_sets import EvalDataset
from slime.config.opd import OPDConfig
from slime.config.rollout import DataConfig, SamplingConfig
from slime.config.train import TrainConfig


@dataclass(frozen=True)
class ClusterConfig:
    """Where processes go. Without GPUs every "GPU" is one CPU process (a train rank or an engine)."""

    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 1
    rollout_num_gpus: int = 1
    rollout_num_gpus_per_engine: int = 1
    colocate: bool = False
    offload: bool = False
    train_backend: str = "fsdp"
    rollout_backend: str = "torch"
    device: str = "cpu"
    external_engine_addrs: tuple[str, ...] = ()
    """`--rollout-external-engine-addrs`: running servers (http://host:port) used instead of launching."""
    sglang_server_args: tuple[str, ...] = ()
    """SGLang command-line arguments from the `--sglang-*` flags given (slime.config.sglang_args)."""
    router_ip: str | None = None
    router_port: int | None = None
    """`--sglang-router-ip/--sglang-router-port`: a running sglang-router to register the engines with."""
    offload_rollout: bool = False
    """Colocated engines release their memory while the trainer trains (slime's default with
    --colocate; off with --no-offload-rollout)."""

    @property
    def num_train_ranks(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def num_engines(self) -> int:
        if self.external_engine_addrs:
            return len(self.external_engine_addrs)
        return self.rollout_num_gpus // self.rollout_num_gpus_per_engine


STALE_ACTIONS = ("requeue", "drop")
PAUSE_MODES = ("retract", "in_place", "abort")


@dataclass(frozen=True)
class AsyncConfig:
    """Asynchronous rollouts (docs/async.md)."""

    fully_async: bool = False
    """`--fully-async`: the continuous schedule (slime.rollout.continuous)."""
    max_lag: int | None = None
    """`--max-policy-version-lag`: the most weight versions a trained token may be behind (None: no bound)."""
    stale_action: str = "requeue"
    """`--stale-group-action`: a group beyond the bound is requeued (its prompt generated again) or dropped."""
    partial: bool = False
    """`--partial-rollout`: interrupted requests are continued, not generated again."""
    mask_offpolicy: bool = False
    """`--mask-offpolicy-in-partial-rollout`: tokens before a continuation leave the loss."""
    pause_mode: str = "retract"
    """`--pause-generation-mode`: how a push treats requests in flight (fully async only)."""


@dataclass(frozen=True)
class RolloutConfig:
    data: DataConfig | None
    sampling: SamplingConfig
    rollout_batch_size: int
    num_rollout: int | None
    num_epoch: int | None
    over_sampling_batch_size: int | None = None
    rm_type: str | None = None
    custom_rm_path: str | None = None
    group_rm: bool = False
    reward_key: str | None = None
    custom_generate_function_path: str | None = None
    rollout_function_path: str | None = None
    dynamic_sampling_filter_path: str | None = None
    fault_tolerance: bool = False
    """`--use-fault-tolerance`: engines found down are replaced, their groups generated elsewhere."""
    health_check_interval: float = 30.0
    """`--rollout-health-check-interval S`: seconds between two rounds of /health_generate checks."""
    health_check_timeout: float = 30.0
    """`--rollout-health-check-timeout S`: an engine that does not answer within this is down."""
    health_check_first_wait: float = 0.0
    """`--rollout-health-check-first-wait S`: the grace before the first round (and after a resume)."""
    reward_post_process_path: str | None = None
    """`--custom-reward-post-process-path`: slime's f(args, samples) -> (raw_rewards, rewards), whose
    rewards the advantages start from instead of the group-normalised ones."""
    asynchrony: AsyncConfig = AsyncConfig()


@dataclass(frozen=True)
class BridgeConfig:
    transport: str = "tensor"
    buffer_size: int = 512 << 20
    verify: bool = False
    """`--check-weight-sync` (or `--check-precision`): fingerprints compared after every push."""


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    save_interval: int | None = None
    save_hf: str | None = None


@dataclass(frozen=True)
class EvalConfig:
    interval: int | None = None
    datasets: tuple[EvalDataset, ...] = ()
    """`--eval-prompt-data [NAME] PATH ...` or `--eval-config` (slime.config.eval_sets)."""
    before_train: bool = True
    """Evaluate once before the first rollout (off with `--skip-eval-before-train`)."""


@dataclass(frozen=True)
class LoggingConfig:
    use_wandb: bool = False
    wandb_mode: str = "offline"
    wandb_project: str = "slime"
    wandb_group: str | None = None
    use_tensorboard: bool = False
    wandb_team: str | None = None
    """`--wandb-team`: the wandb entity."""
    wandb_key: str | None = None
    """`--wandb-key`: logged in with it (and `--wandb-host`) in online mode."""
    wandb_host: str | None = None
    wandb_dir: str | None = None
    """`--wandb-dir`: where the run's files go (default: the log directory)."""
    tb_dir: str | None = None


@dataclass(frozen=True)
class DebugConfig:
    """The decoupled debug modes (docs/debugging.md)."""

    rollout_only: bool = False
    """`--debug-rollout-only`: engines and rollout manager only; no trainer, no weight push."""
    train_only: bool = False
    """`--debug-train-only` (implied by `--load-debug-rollout-data`): trainer only; no engine."""
    save_rollout_data: str | None = None
    """`--save-debug-rollout-data TEMPLATE` with {rollout_id}."""
    save_eval_data: str | None = None
    """`--save-debug-eval-data TEMPLATE` with {rollout_id}."""
    load_rollout_data: str | None = None
    """`--load-debug-rollout-data TEMPLATE` with {rollout_id}."""
    subsample: float = 1.0
    """`--load-debug-rollout-data-subsample R`: the fraction of prompt groups replayed."""
    allow_tokenizer_mismatch: bool = False
    """`--allow-tokenizer-mismatch`: replay a dump made with another tokenizer."""
    check_precision: bool = False
    """`--check-precision`: the step-0 gates (slime.debug.precision)."""
    precision_dtype: str = "float32"
    """The lower precision of engines and trainer, which the tolerances below default for."""
    precision_logprob_tol: float = 1e-4
    """`--precision-logprob-tol`: largest mean |trainer - engine| log-prob at the first rollout."""
    precision_logprob_max_tol: float = 1e-3
    """`--precision-logprob-max-tol`: largest single-token |trainer - engine| log-prob."""
    push_fault: str | None = None
    """`--debug-push-fault SPEC`: break the weight push on purpose (slime.bridge.faults)."""
    phase_hook: str | None = None
    """`--debug-phase-hook PATH`: f(phase, info) at the named phases of a step (slime.debug.phases)."""
    sync_parameters_path: str | None = None
    """`--debug-sync-parameters-path DIR` (or DEBUG_SYNC_PARAMETERS_PATH): dump every engine's
    parameters before and after the first push, then exit."""
    check_weight_update_equal: bool = False
    """`--check-weight-update-equal`: snapshot, scramble, push, compare, before the first rollout."""
    hang_timeout: float | None = None
    """`--hang-timeout S`: a train step or weight push longer than this dumps every rank's stacks
    to <log dir>/hang/ and ends the job (slime.debug.hang)."""


@dataclass(frozen=True)
class Config:
    cluster: ClusterConfig
    rollout: RolloutConfig
    bridge: BridgeConfig
    checkpoint: CheckpointConfig
    eval: EvalConfig
    logging: LoggingConfig
    train: TrainConfig
    debug: DebugConfig
    args: argparse.Namespace  # for user functions with slime's f(args, ...) signatures only
    critic: CriticConfig | None = None
    """PPO's critic (--advantage-estimator ppo; slime.config.critic)."""
    opd: OPDConfig = field(default_factory=OPDConfig)
    """On-policy distillation (--use-opd; slime.config.opd)."""


# (mean, max) |trainer - engine| log-prob tolerances by the lower precision of engine and
# trainer. float32: measured 1.4e-07 mean, 2.4e-06 max on the demo model (docs/debugging.md);
# bf16/fp16 are starting points for GPU runs, where slime users see ~1e-2 means.
TOLERANCES = {"float32": (1e-4, 1e-3), "bfloat16": (5e-2, 2.0), "float16": (2e-2, 1.0)}
_RANK = {"float32": 0, "float16": 1, "bfloat16": 2}


def lower_precision(*dtypes: str) -> str:
    return max(dtypes, key=lambda d: _RANK[d])
