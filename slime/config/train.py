"""Train-side configuration: typed, frozen dataclasses and the argparse flags that fill them.

The train actor receives a `TrainConfig` and nothing else. `add_train_arguments` registers the
flags (slime's names) in groups; `train_config_from_args` builds the config and validates it
once, with messages that name the flag and the fix. No torch import here.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field

from slime.config.backends import FSDPConfig, MegatronConfig
from slime.config.flags import add_flags, flag, from_flags
from slime.config.lora import LoRAConfig, lora_config
from slime.config.loss import LossConfig
from slime.config.moe import MoEOptions
from slime.config.opd import OPDConfig, opd_config
from slime.config.profile import ProfileConfig, profile_config

LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule (Megatron's flag names)."""

    lr: float = flag("--lr", 1e-6)
    """`--lr`: peak learning rate."""
    min_lr: float = flag("--min-lr", 0.0)
    """`--min-lr`: floor of the linear/cosine decay."""
    lr_decay_style: str = flag("--lr-decay-style", "constant", choices=LR_DECAY_STYLES)
    """`--lr-decay-style`: constant, linear or cosine (after warm-up)."""
    lr_warmup_iters: int = flag("--lr-warmup-iters", 0)
    """`--lr-warmup-iters`: optimizer steps of linear warm-up from --lr-warmup-init to --lr."""
    lr_warmup_init: float = flag("--lr-warmup-init", 0.0)
    """the learning rate of the first warm-up step"""
    lr_decay_iters: int | None = flag("--lr-decay-iters", None, type=int)
    """`--lr-decay-iters`: the optimizer step at which linear/cosine decay reaches --min-lr, counted
    from the first step (warm-up included), as in Megatron-LM."""
    weight_decay: float = flag("--weight-decay", 0.0)
    """`--weight-decay`: AdamW's decoupled weight decay."""
    adam_beta1: float = flag("--adam-beta1", 0.9)
    """AdamW's first-moment decay."""
    adam_beta2: float = flag("--adam-beta2", 0.999)
    """AdamW's second-moment decay."""
    adam_eps: float = flag("--adam-eps", 1e-8)
    """AdamW's epsilon."""
    clip_grad: float = flag("--clip-grad", 1.0)
    """`--clip-grad`: max global gradient norm; 0 disables clipping."""
    optimizer: str = "adam"
    """`--optimizer`: adam (AdamW, as Megatron-LM's adam) or sgd."""
    sgd_momentum: float = 0.9
    """`--sgd-momentum`: momentum of --optimizer sgd."""
    reset_optimizer_states: bool = flag("--reset-optimizer-states", False)
    """clear the optimizer's states (Adam's moments and step counts, SGD's momentum) before each
    rollout's first step, as slime; the learning-rate schedule goes on"""
    use_stateless_adam: bool = flag("--use-stateless-adam", False)
    """Adam without moments kept between steps: every step is Adam's first (bias-corrected: -lr * g
    / (|g| + eps), weight decay decoupled), as slime's StatelessAdam; nothing to checkpoint"""
    only_train_params_name_list: tuple[str, ...] | None = flag(
        "--only-train-params-name-list", None, nargs="*", metavar="REGEX"
    )
    """train only the parameters whose name matches one of these (re.search), freeze the rest; names
    are the backend's own: Megatron's (decoder.layers.3.mlp.linear_fc1.weight) or Hugging Face's
    with fsdp"""
    freeze_params_name_list: tuple[str, ...] | None = flag(
        "--freeze-params-name-list", None, nargs="*", metavar="REGEX"
    )
    """freeze the parameters whose name matches one of these (re.search); names as
    --only-train-params-name-list's"""

    def __post_init__(self) -> None:
        if self.lr < 0 or self.min_lr < 0:
            raise ValueError("--lr and --min-lr must be >= 0")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(
                f"--lr-decay-style {self.lr_decay_style!r} is not one of {', '.join(LR_DECAY_STYLES)}"
            )
        if self.lr_decay_style != "constant" and not self.lr_decay_iters:
            raise ValueError(f"--lr-decay-style {self.lr_decay_style} needs --lr-decay-iters > 0")
        if self.lr_warmup_iters < 0:
            raise ValueError("--lr-warmup-iters must be >= 0")
        if not 0 <= self.lr_warmup_init <= self.lr:
            raise ValueError(f"--lr-warmup-init ({self.lr_warmup_init}) must be in [0, --lr ({self.lr})]")
        if self.lr_decay_iters and self.lr_decay_iters <= self.lr_warmup_iters:
            raise ValueError(
                f"--lr-decay-iters ({self.lr_decay_iters}) counts from the first step, warm-up included "
                f"(Megatron-LM's rule), so it must exceed --lr-warmup-iters ({self.lr_warmup_iters})"
            )
        if self.clip_grad < 0:
            raise ValueError("--clip-grad must be >= 0 (0 disables clipping)")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"--optimizer must be adam or sgd, got {self.optimizer!r}")
        if self.only_train_params_name_list is not None and self.freeze_params_name_list is not None:
            raise ValueError(
                "give one of --only-train-params-name-list (what trains) and --freeze-params-name-list "
                "(what does not)"
            )
        for name in ("only_train_params_name_list", "freeze_params_name_list"):
            for pattern in getattr(self, name) or ():
                try:
                    re.compile(pattern)
                except re.error as e:
                    raise ValueError(
                        f"--{name.replace('_', '-')}: {pattern!r} is not a regular expression ({e})"
                    ) from None
        if self.use_stateless_adam and self.optimizer != "adam":
            raise ValueError(f"--use-stateless-adam is a variant of --optimizer adam, not {self.optimizer}")


@dataclass(frozen=True)
class BatchConfig:
    """How a rollout is cut into optimizer steps and micro-batches."""

    global_batch_size: int | None = flag("--global-batch-size", None, type=int)
    """`--global-batch-size`: samples per optimizer step over all data-parallel ranks
    (default: the whole rollout, i.e. one step per rollout)."""
    num_steps_per_rollout: int | None = flag("--num-steps-per-rollout", None, type=int)
    """`--num-steps-per-rollout`: optimizer steps per rollout; the global batch is then the
    rollout size divided by it (must agree with --global-batch-size when both are given)."""
    micro_batch_size: int = flag("--micro-batch-size", 1)
    """`--micro-batch-size`: samples per forward/backward when batches are not dynamic."""
    use_dynamic_batch_size: bool = flag("--use-dynamic-batch-size", False)
    """`--use-dynamic-batch-size`: pack micro-batches under --max-tokens-per-gpu instead."""
    balance_by_flops: bool = False  # slime's --balance-by-flops (slime.utils.step_plans.flops_micro_batches)
    max_tokens_per_gpu: int | None = flag("--max-tokens-per-gpu", None, type=int)
    """`--max-tokens-per-gpu`: token budget of a training micro-batch (its real or padded tokens)."""
    log_probs_max_tokens_per_gpu: int | None = flag("--log-probs-max-tokens-per-gpu", None, type=int)
    """`--log-probs-max-tokens-per-gpu`: token budget of the log-prob pass (default: the train one)."""
    padded_micro_batches: bool = flag("--padded-micro-batches", False)
    """right-pad each micro-batch to its longest sample instead of packing its samples into one row
    (both backends pack by default; for comparison)"""
    log_probs_chunk_size: int = flag("--log-probs-chunk-size", -1)
    """response tokens per chunk of the log-softmax over the vocabulary, so no [tokens x vocab]
    float32 tensor is held at once (-1: no chunks); the values are the same"""

    def __post_init__(self) -> None:
        if self.global_batch_size is not None and self.global_batch_size < 1:
            raise ValueError("--global-batch-size must be >= 1")
        if self.micro_batch_size < 1:
            raise ValueError("--micro-batch-size must be >= 1")
        if self.num_steps_per_rollout is not None and self.num_steps_per_rollout < 1:
            raise ValueError("--num-steps-per-rollout must be >= 1")
        if self.use_dynamic_batch_size and not self.max_tokens_per_gpu:
            raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu")
        for name in ("max_tokens_per_gpu", "log_probs_max_tokens_per_gpu"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.log_probs_chunk_size == 0 or self.log_probs_chunk_size < -1:
            raise ValueError(
                f"--log-probs-chunk-size must be a positive number of tokens or -1 (no chunks), "
                f"got {self.log_probs_chunk_size}"
            )

    def global_batch_for(self, num_samples: int) -> int:
        """Samples per optimizer step for a rollout of `num_samples` samples (executions, where
        an execution gave several samples: a step keeps them together)."""
        size = self.global_batch_size or num_samples
        if self.num_steps_per_rollout is not None:
            if num_samples % self.num_steps_per_rollout:
                raise ValueError(
                    f"the rollout has {num_samples} samples, which --num-steps-per-rollout "
                    f"{self.num_steps_per_rollout} does not divide"
                )
            derived = num_samples // self.num_steps_per_rollout
            if self.global_batch_size is not None and self.global_batch_size != derived:
                raise ValueError(
                    f"--global-batch-size {self.global_batch_size} disagrees with --num-steps-per-rollout "
                    f"{self.num_steps_per_rollout} for a rollout of {num_samples} samples; give only one"
                )
            size = derived
        return size

    def check_layout(self, dp_size: int, global_batch_size: int | None = None) -> None:
        """Refuse a global batch that the data-parallel layout cannot split evenly."""
        size = global_batch_size or self.global_batch_size
        if size is None:
            return
        unit = dp_size if self.use_dynamic_batch_size else dp_size * self.micro_batch_size
        if size % unit:
            what = (
                f"the number of data-parallel ranks ({dp_size})"
                if self.use_dynamic_batch_size
                else f"--micro-batch-size × data-parallel ranks ({self.micro_batch_size} × {dp_size})"
            )
            raise ValueError(
                f"--global-batch-size {size} is not divisible by {what}; choose a multiple of {unit}"
            )


@dataclass(frozen=True)
class ModelOptions:
    """Megatron-LM's training flags that both backends read (slime.config.megatron_lm)."""

    attention_dropout: float = 0.0
    """`--attention-dropout`: on attention probabilities in training steps (never in log-prob passes)."""
    hidden_dropout: float = 0.0
    """`--hidden-dropout`: after attention and MLP in training steps (Megatron only)."""
    attention_softmax_in_fp32: bool = False
    """`--attention-softmax-in-fp32` (Megatron under --bf16)."""
    recompute_granularity: str | None = None
    """`--recompute-granularity`: full or selective (megatron-core); FSDP: full = gradient checkpointing."""
    recompute_method: str | None = None
    recompute_num_layers: int | None = None

    def __post_init__(self) -> None:
        for name in ("attention_dropout", "hidden_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")
        if self.recompute_method is not None and self.recompute_granularity != "full":
            raise ValueError(
                "--recompute-method applies to --recompute-granularity full: add it, or drop the method"
            )
        if self.recompute_num_layers is not None and self.recompute_method is None:
            raise ValueError("--recompute-num-layers needs --recompute-method uniform or block")
        if self.recompute_method is not None and self.recompute_num_layers is None:
            raise ValueError(f"--recompute-method {self.recompute_method} needs --recompute-num-layers")


@dataclass(frozen=True)
class TrainConfig:
    """Everything a train actor needs."""

    hf_checkpoint: str = flag("--hf-checkpoint")
    """Hugging Face model directory"""
    backend: str = "fsdp"
    """`--train-backend`: fsdp (slime.backends.fsdp) or megatron (slime.backends.megatron)."""
    ref_load: str | None = flag("--ref-load", None)
    """reference weights (default: --hf-checkpoint)"""
    device: str = "cpu"
    """`--device`: cpu (gloo) or cuda (NCCL)."""
    seed: int = flag("--seed", 1234)
    """`--seed`: the trainer's random seed (and the engines' with --deterministic-mode)."""
    rollout_temperature: float = flag("--rollout-temperature", 1.0)
    """`--rollout-temperature`: log-probs and entropy are computed at this temperature."""
    load: str | None = flag("--load", None)
    """checkpoint root to resume from"""
    override_opt_param_scheduler: bool = flag("--override-opt-param-scheduler", False)
    """`--override-opt-param-scheduler`: on resume, use the flags' LR schedule, not the saved one."""
    distributed_timeout_minutes: float = flag("--distributed-timeout-minutes", 10.0)
    """`--distributed-timeout-minutes`: timeout of every collective of the train group."""
    peak_tflops: float | None = flag("--peak-tflops", None, type=float, metavar="TFLOPS")
    """a train GPU's peak TFLOPS, for perf/actor_train_mfu (perf/actor_train_tflops / this);
    default: the dense BF16 peak of a known NVIDIA GPU (slime.utils.flops.PEAK_BF16_TFLOPS); on a
    CPU or another GPU without it, no MFU is reported"""
    save_debug_train_data: str | None = flag("--save-debug-train-data", None, metavar="TEMPLATE")
    """per rank and rollout, what it trained on (tokens, masks, log-probs, advantages, rewards);
    TEMPLATE has {rollout_id} and {rank}"""
    deterministic: bool = False
    """`--deterministic-mode`: seeded, deterministic kernels (slime.utils.seed); the rollout
    seeds every sample and the engines run batch-invariant."""
    check_precision: bool = False
    """`--check-precision`: measure what the step-0 gates need (TrainOutput.precision)."""
    loss: LossConfig = field(default_factory=LossConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    model: ModelOptions = field(default_factory=ModelOptions)
    moe: MoEOptions = field(default_factory=MoEOptions)
    opd: OPDConfig = field(default_factory=OPDConfig)
    """On-policy distillation (slime.config.opd): the penalty, and with --opd-type megatron the teacher."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters instead of full fine-tuning (slime.config.lora)."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """--use-pytorch-profiler's windows (slime.config.profile)."""
    plugin_args: argparse.Namespace | None = field(default=None, compare=False, repr=False)
    """The parsed command line, for slime's loss hooks (`fn(args, ...)`); only with a hook given."""

    def __post_init__(self) -> None:
        if self.moe.use_routing_replay and (
            self.loss.use_rollout_logprobs or self.loss.loss_type != "policy_loss"
        ):
            skipper = (
                "--use-rollout-logprobs"
                if self.loss.use_rollout_logprobs
                else f"--loss-type {self.loss.loss_type}"
            )
            raise ValueError(
                "--use-routing-replay (R2) replays the routing of the trainer's log-prob pass, which "
                f"{skipper} skips: drop one of them (or use --use-rollout-routing-replay)"
            )
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.backend not in ("fsdp", "megatron"):
            raise ValueError(f"--train-backend must be fsdp or megatron, got {self.backend!r}")
        if self.rollout_temperature <= 0:
            raise ValueError("--rollout-temperature must be > 0")
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ValueError(f"--peak-tflops must be > 0 (a GPU's peak TFLOPS), got {self.peak_tflops}")
        if not self.distributed_timeout_minutes > 0:
            raise ValueError(
                f"--distributed-timeout-minutes must be > 0, got {self.distributed_timeout_minutes}"
            )
        if self.save_debug_train_data is not None:
            from slime.utils.files import template_problem

            problem = template_problem(
                self.save_debug_train_data, "--save-debug-train-data", ("rollout_id", "rank")
            )
            if problem:
                raise ValueError(problem)
        o = self.optimizer
        if self.lora.enabled and (
            o.only_train_params_name_list or o.freeze_params_name_list or self.loss.ref_update_interval
        ):
            raise ValueError(
                "--lora-rank trains the adapters alone, the base weights frozen and the reference "
                "(adapters off): drop --only-train-params-name-list / --freeze-params-name-list / "
                "--ref-update-interval"
            )
        if self.fsdp.cpu_offload and self.device != "cuda":
            raise ValueError(
                "--fsdp-cpu-offload only makes sense with --device cuda (parameters already live on CPU)"
            )


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the trainer's flags on `parser` (each declared on its config field), grouped as
    they appear in --help."""
    add_flags(parser, TrainConfig, "train: model and devices")["train: model and devices"].add_argument(
        "--device",
        choices=["auto", "cpu", "cuda"],
        default="auto",
        help='auto: cuda when a GPU is visible, else cpu (every "GPU" is then one CPU process)',
    )
    add_flags(parser, LossConfig, "train: loss")
    add_flags(parser, OptimizerConfig, "train: optimizer")
    add_flags(parser, BatchConfig, "train: batching")
    add_flags(parser, FSDPConfig, "train: FSDP")
    add_flags(parser, ProfileConfig, "train: profiling (docs/debugging.md, Profiling)")
    megatron = "megatron (--train-backend megatron; docs/megatron.md)"
    add_flags(parser, MegatronConfig, megatron)[megatron].add_argument(
        "--transformer-impl",
        choices=["auto", "local", "transformer_engine"],
        default="auto",
        help="auto: transformer_engine on GPUs (Megatron-LM's default), local (megatron-core's torch "
        "layers) on CPU",
    )


def train_config_from_args(ns: argparse.Namespace) -> TrainConfig:
    """The validated TrainConfig of parsed flags (ValueError names the flag on bad input)."""
    if not ns.hf_checkpoint:
        raise ValueError("--hf-checkpoint is required: the Hugging Face model directory to train")
    from slime.config.resolve import resolve, resolved

    if not resolved(ns):  # a parser of the train flags alone (tools, tests): `auto` decided here
        resolve(ns)
    return from_flags(
        TrainConfig,
        ns,
        backend=getattr(ns, "train_backend", "fsdp"),
        device=ns.device,
        check_precision=getattr(ns, "check_precision", False),
        deterministic=getattr(ns, "deterministic_mode", False),
        loss=from_flags(LossConfig, ns),
        optimizer=from_flags(OptimizerConfig, ns),
        batch=from_flags(BatchConfig, ns),
        fsdp=from_flags(FSDPConfig, ns),
        megatron=from_flags(MegatronConfig, ns),
        model=from_flags(ModelOptions, ns),
        moe=from_flags(MoEOptions, ns),
        opd=opd_config(ns) if hasattr(ns, "use_opd") else OPDConfig(),
        lora=lora_config(ns),
        profile=profile_config(ns),
        plugin_args=_plugin_args(ns),
    )


def _plugin_args(ns: argparse.Namespace) -> argparse.Namespace | None:
    hooks = (
        getattr(ns, "custom_tis_function_path", None),
        getattr(ns, "custom_pg_loss_reducer_function_path", None),
    )
    return argparse.Namespace(**vars(ns)) if any(hooks) else None
