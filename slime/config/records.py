"""The typed configuration a job runs with, one record per component (slime.config.arguments
builds them from the command line)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import dataclass, field

from slime.config.critic import CriticConfig
from slime.config.debug import DebugConfig
from slime.config.eval_sets import EvalDataset
from slime.config.flags import flag
from slime.config.opd import OPDConfig
from slime.config.rollout import TRANSPORTS, DataConfig, SamplingConfig, json_object
from slime.config.train import TrainConfig


def env_object(text: str) -> dict[str, str]:
    """--train-env-vars: a JSON object of names to values (numbers and booleans as JSON writes them)."""
    value = json_object(text)
    if any(isinstance(v, (dict, list)) or v is None for v in value.values()):
        raise argparse.ArgumentTypeError(
            'give a JSON object of names to strings, e.g. \'{"NCCL_DEBUG": "INFO"}\''
        )
    return {str(k): v if isinstance(v, str) else json.dumps(v) for k, v in value.items()}


@dataclass(frozen=True)
class ClusterConfig:
    """Where processes go. Without GPUs every "GPU" is one CPU process (a train rank or an engine)."""

    actor_num_nodes: int = flag("--actor-num-nodes", 1)
    """Nodes the train ranks span."""
    actor_num_gpus_per_node: int = flag("--actor-num-gpus-per-node", 1)
    """Train ranks per node, a GPU each (on a machine without GPUs, a CPU process each)."""
    rollout_num_gpus: int = flag("--rollout-num-gpus", 1, unset=None, type=int)
    """default: 1, or the trainer's with --colocate"""
    rollout_num_gpus_per_engine: int = flag("--rollout-num-gpus-per-engine", 1)
    """GPUs of one engine, on one node: its tensor-parallel size (SGLang's --tp-size)."""
    colocate: bool = flag("--colocate", False)
    """trainer and engines share devices"""
    offload: bool = flag("--offload", False)
    """--offload-train and --offload-rollout: the trainer and the engines each give their device
    memory up while the other works (the default with --colocate)"""
    train_backend: str = flag("--train-backend", "fsdp", unset="auto", choices=["auto", "fsdp", "megatron"])
    """auto: megatron on GPUs (as in slime), fsdp on CPU (slime.config.resolve)"""
    rollout_backend: str = flag(
        "--rollout-backend", "torch", unset="auto", choices=["auto", "torch", "sglang"]
    )
    """auto: sglang on GPUs (as in slime), the built-in torch engine on CPU"""
    device: str = "cpu"
    """`--device` (the trainer's flag: slime.config.train), resolved from `auto`."""
    external_engine_addrs: tuple[str, ...] = flag(
        "--rollout-external-engine-addrs", [], unset=None, nargs="+", metavar="HOST:PORT"
    )
    """attach these already-running engines (torch engine or SGLang servers) instead of launching
    any; the trainer's weights are pushed to them before the first rollout"""
    sglang_server_args: tuple[str, ...] = ()
    """SGLang command-line arguments from the `--sglang-*` flags given (slime.config.sglang_args)."""
    router_ip: str | None = flag("--sglang-router-ip", None)
    """a running sglang-router to register the engines with (--rollout-backend sglang starts one
    otherwise); custom rollout functions post to it"""
    router_port: int | None = flag("--sglang-router-port", None, type=int)
    """`--sglang-router-ip/--sglang-router-port`: a running sglang-router to register the engines with."""
    train_env_vars: Mapping[str, str] | None = flag("--train-env-vars", None, type=env_object, metavar="JSON")
    """environment variables of the train ranks' processes, a JSON object ({"NCCL_DEBUG": "INFO"})"""
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

    fully_async: bool = flag("--fully-async", False)
    """the continuous schedule: generation never stops at a rollout boundary; each step trains on
    the next --rollout-batch-size groups that finished, pushes happen while requests are in
    flight (slime's --rollout-function-path
    slime.rollout.fully_async_rollout.generate_rollout_fully_async is the same)"""
    max_lag: int | None = None
    """`--max-policy-version-lag`: the most weight versions a trained token may be behind (None: no bound)."""
    stale_action: str = "requeue"
    """`--stale-group-action`: a group beyond the bound is requeued (its prompt generated again) or
    dropped."""
    partial: bool = flag("--partial-rollout", False)
    """a request interrupted by a push (--pause-generation-mode abort) or by the end of a rollout
    (over-sampling) keeps its tokens and log-probs and is continued with the new weights"""
    mask_offpolicy: bool = flag("--mask-offpolicy-in-partial-rollout", False)
    """with --partial-rollout: the tokens made before the continuation (by older weights) are masked
    out of the loss"""
    pause_mode: str = "retract"
    """`--pause-generation-mode`: how a push treats requests in flight (fully async only)."""


@dataclass(frozen=True)
class RolloutConfig:
    data: DataConfig | None
    sampling: SamplingConfig
    rollout_batch_size: int = flag("--rollout-batch-size", type=int)
    """prompts per rollout"""
    num_rollout: int | None = flag("--num-rollout", type=int, group="data")
    """Rollouts to train on, one weight version each (or give --num-epoch)."""
    num_epoch: int | None = flag("--num-epoch", type=int, group="data")
    """Passes over the prompts, where --num-rollout is not given: the rollouts are the epochs' prompts over
    --rollout-batch-size."""
    over_sampling_batch_size: int | None = flag("--over-sampling-batch-size", None, type=int)
    """Prompts started at a time when a --dynamic-sampling-filter-path drops groups (default:
    --rollout-batch-size): more are started until the rollout has its --rollout-batch-size kept groups."""
    dynamic_sampling_filter_path: str | None = flag("--dynamic-sampling-filter-path", None)
    """A function (package.module.function) that keeps or drops each finished group, slime's dynamic sampling
    (slime.rollout.filter_hub has slime's)."""
    custom_generate_function_path: str | None = flag("--custom-generate-function-path", None)
    """A function (package.module.function) that generates one sample in place of the built-in request to the
    engines (agents, tools, multi-turn)."""
    rollout_function_path: str | None = flag("--rollout-function-path", None)
    """A function (package.module.function) that makes a whole rollout in place of the built-in one
    (slime.rollout.fully_async_rollout.generate_rollout_fully_async, the SFT rollout, your own)."""
    rm_type: str | None = flag("--rm-type", None)
    """slime's rule rewards (slime.rollout.rm_hub): deepscaler, dapo, math, f1, gpqa, random,
    boxed_<type>, remote_rm (with --rm-url); or exact"""
    custom_rm_path: str | None = flag("--custom-rm-path", None)
    """package.module.function"""
    group_rm: bool = flag("--group-rm", False)
    """Score each prompt group with one reward call over its samples, not one call per sample."""
    reward_key: str | None = flag("--reward-key", None)
    """key of a dict reward to train on"""
    global_dataset: bool = flag(
        "--disable-rollout-global-dataset", True, dest="rollout_global_dataset", action="store_false"
    )
    """no prompt dataset: the --rollout-function-path brings its own data (its data_source hands out
    groups of blank samples, numbered), and checkpoints carry no data position"""
    eval_reward_key: str | None = flag("--eval-reward-key", None)
    """the key of a dict reward that evaluation reports (default: --reward-key)"""
    log_passrate: bool = flag("--log-passrate", False)
    """log pass@k (k = 1, 2, 4, ... up to the group size; a sample passes with reward exactly 1):
    passrate/pass@k per rollout, eval/<name>-pass@k per evaluation"""
    log_reward_category: str | None = flag("--log-reward-category", None, metavar="KEY")
    """log the share of samples per value of reward[KEY] (dict rewards): rollout/error_cat/<value>,
    eval/<name>/error_cat/<value>"""
    log_multi_turn: bool = flag("--log-multi-turn", False)
    """log multi_turn/*: response lengths with and without the tool tokens (loss mask), rounds from
    metadata['round_number']"""
    fault_tolerance: bool = flag("--use-fault-tolerance", False, group="cluster")
    """check the engines' health: an engine that is down (health check, failed request or control
    call) has its groups generated again elsewhere, is restarted on its bundle and given the
    current weights before it takes requests again (docs/engine.md)"""
    health_check_interval: float = flag(
        "--rollout-health-check-interval", 30.0, unset=None, group="cluster", metavar="SECONDS"
    )
    """with --use-fault-tolerance: seconds between two rounds of /health_generate checks (30)"""
    health_check_timeout: float = flag(
        "--rollout-health-check-timeout", 30.0, unset=None, group="cluster", metavar="SECONDS"
    )
    """with --use-fault-tolerance: an engine whose /health_generate does not answer within this is
    down (30)"""
    health_check_first_wait: float = flag(
        "--rollout-health-check-first-wait", 0.0, unset=None, group="cluster", metavar="SECONDS"
    )
    """with --use-fault-tolerance: the wait before the first round of checks, and after colocated
    engines take their memory back (0)"""
    reward_post_process_path: str | None = flag(
        "--custom-reward-post-process-path", None, metavar="module.function"
    )
    """slime's f(args, samples) -> (raw_rewards, rewards): the rewards the advantages start from, in
    place of the group normalisation"""
    asynchrony: AsyncConfig = AsyncConfig()


@dataclass(frozen=True)
class BridgeConfig:
    transport: str = flag("--update-weight-transport", "tensor", unset=None, choices=(*TRANSPORTS, "nccl"))
    """tensor (shared memory on CPU, CUDA IPC with --colocate on GPU), distributed (a gloo/NCCL
    group) or disk; default (and slime's nccl): distributed for GPU engines on their own GPUs,
    else tensor"""
    buffer_size: int = flag("--update-weight-buffer-size", 512 << 20)
    """bytes per bucket"""
    mode: str = flag("--update-weight-mode", "full", choices=["full", "delta"])
    """full: every push sends all the weights; delta (with --update-weight-transport disk): only the
    bytes that changed, published under --update-weight-disk-dir and pulled into each engine
    host's --update-weight-local-checkpoint-dir (docs/engine.md)"""
    disk_dir: str | None = flag("--update-weight-disk-dir", None, metavar="DIR")
    """the disk transport's directory, shared with every engine host (default, full mode: a
    temporary directory on train rank 0's node)"""
    local_dir: str | None = flag("--update-weight-local-checkpoint-dir", None, metavar="DIR")
    """delta mode: each engine host's own full checkpoint, patched in place by every push and
    reloaded"""
    delta_encoding: str = flag("--update-weight-delta-encoding", "xor", choices=["xor", "overwrite"])
    """xor (new ^ old: smallest, applied exactly once) or overwrite (positions and new bytes:
    larger, idempotent); both are checked per tensor, so a re-applied version converges either
    way"""
    delta_checksum: str = flag(
        "--update-weight-delta-checksum", "xxh3-128", choices=["xxh3-128", "blake3", "adler32"]
    )
    """each changed tensor's integrity check (xxh3-128: fast, 128 bits; blake3: cryptographic;
    adler32: 32 bits)"""
    disk_keep_files: bool = flag("--update-weight-disk-keep-files", False)
    """full disk pushes: keep every pushed directory (by default each is removed once the next is
    loaded)"""
    update_weights_interval: int = flag("--update-weights-interval", 1)
    """push the weights to the engines after every N trained rollouts (train.py and train_async.py
    alike; slime's train.py pushes every rollout whatever it says): samples may then be N - 1
    versions older"""
    verify: bool = False
    """`--check-weight-sync` (or `--check-precision`): fingerprints compared after every push."""


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = flag("--save", None)
    """Where checkpoints go (iter_NNNNNNN/ per save) and, unless SLIME_LOG_DIR says otherwise, the logs."""
    save_interval: int | None = flag("--save-interval", None, type=int)
    """A checkpoint every this many rollouts (and after the last); without it, only after the last."""
    save_hf: str | None = flag("--save-hf", None)
    """At the end, the trained weights as a Hugging Face directory here (LoRA: a PEFT adapter directory)."""
    start_rollout_id: int | None = flag("--start-rollout-id", None, type=int)
    """the first rollout of the loop (default: the one after the checkpoint --load resumes from, or
    0)"""


@dataclass(frozen=True)
class EvalConfig:
    interval: int | None = flag("--eval-interval", None, type=int)
    """Evaluate after every N rollouts (slime.loop.hooks.Evaluate)."""
    datasets: tuple[EvalDataset, ...] = ()
    """`--eval-prompt-data [NAME] PATH ...` or `--eval-config` (slime.config.eval_sets)."""
    before_train: bool = True
    """Evaluate once before the first rollout (off with `--skip-eval-before-train`)."""
    config_path: str | None = None
    """`--eval-config`: the YAML file the sets come from (None: `--eval-prompt-data`)."""


@dataclass(frozen=True)
class LoggingConfig:
    use_wandb: bool = flag("--use-wandb", False)
    """Log every step's metrics to Weights & Biases (offline unless a key or --wandb-mode online)."""
    wandb_mode: str = "offline"
    wandb_project: str = flag("--wandb-project", "slime")
    """The wandb project."""
    wandb_group: str | None = flag("--wandb-group", None)
    """The wandb group (with a random suffix unless --disable-wandb-random-suffix)."""
    use_tensorboard: bool = flag("--use-tensorboard", False)
    """Log every step's metrics to TensorBoard (see --tb-dir)."""
    wandb_team: str | None = flag("--wandb-team", None)
    """the wandb entity"""
    wandb_key: str | None = flag("--wandb-key", None)
    """API key: wandb.login in online mode (the default with a key)"""
    wandb_host: str | None = flag("--wandb-host", None)
    """the wandb server for --wandb-key"""
    wandb_dir: str | None = flag("--wandb-dir", None)
    """the run's local files (default: the log directory)"""
    tb_dir: str | None = flag("--tb-dir", None)
    """TensorBoard's directory (default: TENSORBOARD_DIR, else tensorboard_log/PROJECT/EXPERIMENT with
    --tb-project-name, else <log dir>/tensorboard)."""
    tb_project_name: str | None = flag("--tb-project-name", None)
    """TensorBoard's directory is tensorboard_log/PROJECT/EXPERIMENT (slime's layout) unless
    --tb-dir or TENSORBOARD_DIR names one"""
    tb_experiment_name: str | None = flag("--tb-experiment-name", None)
    """with --tb-project-name (default: the start time, %Y%m%d_%H%M%S)"""
    wandb_run_id: str | None = flag("--wandb-run-id", None)
    """log into this wandb run (resumed if it exists) instead of a new one"""
    wandb_random_suffix: bool = flag(
        "--disable-wandb-random-suffix", True, dest="wandb_random_suffix", action="store_false"
    )
    """the wandb group and run name are --wandb-group as given (by default, as slime, an 8-character
    random suffix keeps runs of one group apart)"""
    wandb_always_use_train_step: bool = flag("--wandb-always-use-train-step", False)
    """every record's step is the optimizer steps taken so far (rollouts x steps per rollout), not
    the rollouts trained (metrics.jsonl, TensorBoard and wandb alike)"""


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
