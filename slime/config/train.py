"""Train-side configuration: typed, frozen dataclasses and the argparse flags that fill them.

The train actor receives a `TrainConfig` and nothing else. `add_train_arguments` registers the
flags (slime's names) in groups; `train_config_from_args` builds the config and validates it
once, with messages that name the flag and the fix. No torch import here.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from slime.config.lora import LoRAConfig, lora_config
from slime.config.loss import ESTIMATORS, KL_TYPES, LOSS_TYPES, LossConfig
from slime.config.opd import OPDConfig, opd_config

LR_DECAY_STYLES = ("constant", "linear", "cosine")
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule (Megatron's flag names)."""

    lr: float = 1e-6
    """`--lr`: peak learning rate."""
    min_lr: float = 0.0
    """`--min-lr`: floor of the linear/cosine decay."""
    lr_decay_style: str = "constant"
    """`--lr-decay-style`: constant, linear or cosine (after warm-up)."""
    lr_warmup_iters: int = 0
    """`--lr-warmup-iters`: optimizer steps of linear warm-up from --lr-warmup-init to --lr."""
    lr_warmup_init: float = 0.0
    """`--lr-warmup-init`: the learning rate of the first warm-up step."""
    lr_decay_iters: int | None = None
    """`--lr-decay-iters`: the optimizer step at which linear/cosine decay reaches --min-lr, counted
    from the first step (warm-up included), as in Megatron-LM."""
    weight_decay: float = 0.0
    """`--weight-decay`."""
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """`--clip-grad`: max global gradient norm; 0 disables clipping."""
    optimizer: str = "adam"
    """`--optimizer`: adam (AdamW, as Megatron-LM's adam) or sgd."""
    sgd_momentum: float = 0.9
    """`--sgd-momentum`: momentum of --optimizer sgd."""

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
                f"--lr-decay-iters ({self.lr_decay_iters}) counts from the first step, warm-up included (Megatron-LM's "
                f"rule), so it must exceed --lr-warmup-iters ({self.lr_warmup_iters})"
            )
        if self.clip_grad < 0:
            raise ValueError("--clip-grad must be >= 0 (0 disables clipping)")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"--optimizer must be adam or sgd, got {self.optimizer!r}")


@dataclass(frozen=True)
class BatchConfig:
    """How a rollout is cut into optimizer steps and micro-batches."""

    global_batch_size: int | None = None
    """`--global-batch-size`: samples per optimizer step over all data-parallel ranks
    (default: the whole rollout, i.e. one step per rollout)."""
    num_steps_per_rollout: int | None = None
    """`--num-steps-per-rollout`: optimizer steps per rollout; the global batch is then the
    rollout size divided by it (must agree with --global-batch-size when both are given)."""
    micro_batch_size: int = 1
    """`--micro-batch-size`: samples per forward/backward when batches are not dynamic."""
    use_dynamic_batch_size: bool = False
    """`--use-dynamic-batch-size`: pack micro-batches under --max-tokens-per-gpu instead."""
    max_tokens_per_gpu: int | None = None
    """`--max-tokens-per-gpu`: token budget of one training micro-batch (its real tokens when
    packed, its padded size with --padded-micro-batches)."""
    log_probs_max_tokens_per_gpu: int | None = None
    """`--log-probs-max-tokens-per-gpu`: token budget of the log-prob pass (default: the train one)."""
    padded_micro_batches: bool = False
    """`--padded-micro-batches` (ours): one right-padded row per sample instead of packed
    micro-batches, for comparison (docs/train.md)."""
    log_probs_chunk_size: int = -1
    """`--log-probs-chunk-size`: compute the log-softmax over the vocabulary for this many
    response tokens at a time (-1: all at once); memory only, the values are the same."""

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
        """Samples per optimizer step for a rollout of `num_samples` samples."""
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
class FSDPConfig:
    """Sharding, precision and memory options of the FSDP2 backend."""

    param_dtype: str = "float32"
    """`--fsdp-param-dtype`: dtype of the gathered parameters in forward/backward (master
    weights and optimizer states stay float32)."""
    reduce_dtype: str = "float32"
    """`--fsdp-reduce-dtype`: dtype of the gradient reduce-scatter."""
    cpu_offload: bool = False
    """`--fsdp-cpu-offload`: keep sharded parameters, gradients and optimizer states in CPU
    memory (GPU only)."""
    gradient_checkpointing: bool = False
    """`--gradient-checkpointing`: recompute decoder-layer activations in backward (read by the
    Megatron actor too: megatron-core's full recompute)."""
    attn_implementation: str = "sdpa"
    """`--attn-implementation`: Hugging Face attention kernel (sdpa, eager, flash_attention_2)."""
    disable_sharding: bool = False
    """`--debug-disable-sharding`: one rank, the plain Hugging Face module without fully_shard
    (plain tensors, no FSDP hooks or collectives in forward/backward) for stepping through."""

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"--fsdp-{name.replace('_', '-')} must be one of {', '.join(DTYPES)}")
        if self.disable_sharding and (self.param_dtype != "float32" or self.reduce_dtype != "float32"):
            raise ValueError(
                "--debug-disable-sharding runs the plain module in float32: drop --fsdp-param-dtype / "
                "--fsdp-reduce-dtype (mixed precision is FSDP's)"
            )
        if self.disable_sharding and self.cpu_offload:
            raise ValueError(
                "--debug-disable-sharding and --fsdp-cpu-offload exclude each other (offload is FSDP's)"
            )


@dataclass(frozen=True)
class MegatronConfig:
    """`--train-backend megatron`'s model parallelism (megatron-core's argument names)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    """Megatron-LM's default: None, the tensor-parallel size."""
    sequence_parallel: bool = False
    make_vocab_size_divisible_by: int = 128
    """The vocabulary is padded to a multiple of this x TP (slime.backends.megatron.convert)."""
    transformer_impl: str = "local"
    """`local` (megatron-core's layer spec) or `transformer_engine`."""
    bf16: bool = False
    """`--bf16`: bfloat16 parameters and activations; float32 master weights, gradient reductions
    and optimizer states (megatron-core's mixed precision, done by the actor)."""

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                     "expert_model_parallel_size", "make_vocab_size_divisible_by"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.expert_tensor_parallel_size is not None and self.expert_tensor_parallel_size < 1:
            raise ValueError(
                f"--expert-tensor-parallel-size must be >= 1, got {self.expert_tensor_parallel_size}"
            )
        if self.transformer_impl not in ("local", "transformer_engine"):
            raise ValueError(
                f"--transformer-impl must be local or transformer_engine, got {self.transformer_impl!r}"
            )


@dataclass(frozen=True)
class MoEOptions:
    """Mixture-of-experts training flags (FSDP: slime.backends.fsdp.moe)."""

    moe_aux_loss_coeff: float = 0.0
    """`--moe-aux-loss-coeff`: megatron-core's load-balancing loss (aux_loss) times this."""
    moe_router_load_balancing_type: str | None = None
    """`--moe-router-load-balancing-type`: aux_loss (the default) or none."""
    moe_router_dtype: str | None = None
    """`--moe-router-dtype`: fp32 or fp64 routing (None: as the model computes it)."""
    use_routing_replay: bool = False
    """`--use-routing-replay` (R2): training steps use the log-prob pass's experts."""
    use_rollout_routing_replay: bool = False
    """`--use-rollout-routing-replay` (R3): log-prob and training passes use the engine's experts."""

    def __post_init__(self) -> None:
        if not self.moe_aux_loss_coeff >= 0:
            raise ValueError(f"--moe-aux-loss-coeff must be >= 0, got {self.moe_aux_loss_coeff}")
        if self.use_routing_replay and self.use_rollout_routing_replay:
            raise ValueError(
                "--use-routing-replay (R2) and --use-rollout-routing-replay (R3) replay different routings: give one"
            )

    @property
    def aux_loss_coeff(self) -> float:
        return 0.0 if self.moe_router_load_balancing_type == "none" else self.moe_aux_loss_coeff

    @property
    def needs_moe(self) -> str | None:
        """The first flag given that only a mixture-of-experts model can honour (None: none)."""
        for flag, on in (
            ("--moe-aux-loss-coeff", self.aux_loss_coeff > 0),
            ("--moe-router-dtype", self.moe_router_dtype is not None),
            ("--use-routing-replay", self.use_routing_replay),
            ("--use-rollout-routing-replay", self.use_rollout_routing_replay),
        ):
            if on:
                return flag
        return None


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

    hf_checkpoint: str
    """`--hf-checkpoint`: Hugging Face model directory (config, weights, tokenizer)."""
    backend: str = "fsdp"
    """`--train-backend`: fsdp (slime.backends.fsdp) or megatron (slime.backends.megatron)."""
    ref_load: str | None = None
    """`--ref-load`: reference-model weights (HF directory; default: --hf-checkpoint)."""
    device: str = "cpu"
    """`--device`: cpu (gloo) or cuda (NCCL)."""
    seed: int = 1234
    """`--seed`."""
    rollout_temperature: float = 1.0
    """`--rollout-temperature`: log-probs and entropy are computed at this temperature."""
    load: str | None = None
    """`--load`: checkpoint root to resume from (holds latest_checkpointed_iteration.txt)."""
    override_opt_param_scheduler: bool = False
    """`--override-opt-param-scheduler`: on resume, use the flags' LR schedule, not the saved one."""
    distributed_timeout_minutes: float = 10.0
    """`--distributed-timeout-minutes`: timeout of every collective of the train group."""
    save_debug_train_data: str | None = None
    """`--save-debug-train-data TEMPLATE` ({rollout_id}, {rank}): what each rank trained on."""
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
    plugin_args: argparse.Namespace | None = field(default=None, compare=False, repr=False)
    """The parsed command line, for slime's loss hooks (`fn(args, ...)`); only with a hook given."""

    def __post_init__(self) -> None:
        if self.moe.use_routing_replay and (
            self.loss.use_rollout_logprobs or self.loss.loss_type != "policy_loss"
        ):
            raise ValueError(
                "--use-routing-replay (R2) replays the routing of the trainer's log-prob pass, which "
                f"{'--use-rollout-logprobs' if self.loss.use_rollout_logprobs else '--loss-type ' + self.loss.loss_type} "
                "skips: drop one of them (or use --use-rollout-routing-replay)"
            )
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.backend not in ("fsdp", "megatron"):
            raise ValueError(f"--train-backend must be fsdp or megatron, got {self.backend!r}")
        if self.rollout_temperature <= 0:
            raise ValueError("--rollout-temperature must be > 0")
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
        if self.fsdp.cpu_offload and self.device != "cuda":
            raise ValueError(
                "--fsdp-cpu-offload only makes sense with --device cuda (parameters already live on CPU)"
            )


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the trainer's flags on `parser`, grouped as they appear in --help."""
    g = parser.add_argument_group("train: model and devices")
    g.add_argument("--hf-checkpoint", help="Hugging Face model directory")
    g.add_argument("--ref-load", default=None, help="reference weights (default: --hf-checkpoint)")
    g.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each decoder layer's activations in backward (FSDP: Hugging Face's "
                   "checkpointing; Megatron: megatron-core's full recompute)")  # fmt: skip
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: cuda when a GPU is visible, else cpu (every \"GPU\" is then one CPU process)")  # fmt: skip
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--rollout-temperature", type=float, default=1.0)
    g.add_argument("--load", default=None, help="checkpoint root to resume from")
    g.add_argument("--override-opt-param-scheduler", action="store_true")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument(
        "--save-debug-train-data", default=None, metavar="TEMPLATE",
        help="per rank and rollout, what it trained on (tokens, masks, log-probs, advantages, rewards); "
        "TEMPLATE has {rollout_id} and {rank}",
    )  # fmt: skip

    g = parser.add_argument_group("train: loss")
    g.add_argument("--loss-type", choices=LOSS_TYPES, default="policy_loss")
    g.add_argument("--advantage-estimator", choices=ESTIMATORS, default="grpo")
    g.add_argument("--disable-grpo-std-normalization", action="store_true")
    g.add_argument("--normalize-advantages", action="store_true")
    g.add_argument("--eps-clip", type=float, default=0.2)
    g.add_argument("--eps-clip-high", type=float, default=None)
    g.add_argument("--eps-clip-c", type=float, default=None)
    g.add_argument("--use-kl-loss", action="store_true")
    g.add_argument("--kl-loss-coef", type=float, default=0.0)
    g.add_argument("--kl-loss-type", choices=KL_TYPES, default="k1")
    g.add_argument(
        "--kl-coef", type=float, default=0.0, help="KL penalty in the token rewards (REINFORCE++, PPO)"
    )
    g.add_argument("--gamma", type=float, default=1.0, help="discount (REINFORCE++ returns, PPO's GAE)")
    g.add_argument("--lambd", type=float, default=1.0, help="GAE's lambda (PPO)")
    g.add_argument(
        "--value-clip", type=float, default=0.2, help="the critic's value loss clips V - V_old (PPO)"
    )
    g.add_argument("--entropy-coef", type=float, default=0.0)
    g.add_argument("--use-tis", action="store_true")
    g.add_argument("--tis-clip", type=float, default=2.0)
    g.add_argument("--tis-clip-low", type=float, default=0.0)
    g.add_argument("--use-opsm", action="store_true",
                   help="off-policy sequence masking (as slime): in a sample whose mean log-ratio old - new over its "
                   "loss tokens exceeds --opsm-delta, the negative-advantage tokens leave the policy loss")  # fmt: skip
    g.add_argument("--opsm-delta", type=float, default=1e-4, help="the threshold of --use-opsm")
    g.add_argument("--use-decoupled-loss", action="store_true",
                   help="AReaL's decoupled PPO: the ratio against the recomputed log-probs (proximal policy), each "
                   "token's loss times exp(proximal - engine log-prob), the behaviour importance weight")  # fmt: skip
    g.add_argument("--behav-imp-weight-cap", type=float, default=None,
                   help="with --use-decoupled-loss: tokens whose behaviour importance weight exceeds it (> 1) "
                   "leave the loss (masked, not clamped as --tis-clip does)")  # fmt: skip
    g.add_argument("--calculate-per-token-loss", action="store_true")
    g.add_argument("--use-rollout-logprobs", action="store_true",
                   help="the engine's log-probs are the old policy of the PPO ratio (no recompute pass)")  # fmt: skip
    g.add_argument("--disable-compute-advantages-and-returns", dest="compute_advantages_and_returns",
                   action="store_false",
                   help="no log-prob passes and no advantages (with --loss-type sft_loss)")  # fmt: skip
    g.add_argument("--disable-rewards-normalization", dest="rewards_normalization", action="store_false",
                   help="no group baseline: advantages from the raw rewards")  # fmt: skip
    g.add_argument("--custom-tis-function-path", default=None, metavar="module.function",
                   help="with --use-tis: slime's TIS hook fn(args, *, pg_loss, train_log_probs, rollout_log_probs, "
                   "loss_masks, total_lengths, response_lengths) -> (pg_loss, loss_masks, metrics)")  # fmt: skip
    g.add_argument("--custom-pg-loss-reducer-function-path", default=None, metavar="module.function",
                   help="slime's pg_loss reducer factory(total_lengths, response_lengths, loss_masks, "
                   "calculate_per_token_loss) -> reduce(pg_loss)")  # fmt: skip

    g = parser.add_argument_group("train: optimizer")
    g.add_argument("--lr", type=float, default=1e-6)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="constant")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument(
        "--lr-warmup-init", type=float, default=0.0, help="the learning rate of the first warm-up step"
    )
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0)

    g = parser.add_argument_group("train: batching")
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--num-steps-per-rollout", type=int, default=None)
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--use-dynamic-batch-size", action="store_true")
    g.add_argument("--max-tokens-per-gpu", type=int, default=None)
    g.add_argument("--log-probs-max-tokens-per-gpu", type=int, default=None)
    g.add_argument("--padded-micro-batches", action="store_true",
                   help="right-pad each micro-batch to its longest sample instead of packing its samples into one "
                   "row (both backends pack by default; for comparison)")  # fmt: skip
    g.add_argument("--log-probs-chunk-size", type=int, default=-1,
                   help="response tokens per chunk of the log-softmax over the vocabulary, so no [tokens x vocab] "
                   "float32 tensor is held at once (-1: no chunks); the values are the same")  # fmt: skip

    g = parser.add_argument_group("train: FSDP")
    g.add_argument("--fsdp-param-dtype", choices=DTYPES, default="float32")
    g.add_argument("--fsdp-reduce-dtype", choices=DTYPES, default="float32")
    g.add_argument("--fsdp-cpu-offload", action="store_true")
    g.add_argument("--attn-implementation", default="sdpa")
    g.add_argument("--debug-disable-sharding", action="store_true",
                   help="one train rank running the plain module (no fully_shard: plain tensors, no FSDP hooks), "
                   "to step through the model in a debugger")  # fmt: skip

    g = parser.add_argument_group("megatron (--train-backend megatron; docs/megatron.md)")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this x TP")  # fmt: skip
    g.add_argument("--transformer-impl", choices=["auto", "local", "transformer_engine"], default="auto",
                   help="auto: transformer_engine on GPUs (Megatron-LM's default), local (megatron-core's torch "
                   "layers) on CPU")  # fmt: skip
    g.add_argument("--bf16", action="store_true",
                   help="bfloat16 parameters and activations, float32 master weights, gradient reductions and "
                   "optimizer states (megatron's mixed precision)")  # fmt: skip


def _pick(cls, ns: argparse.Namespace, prefix: str = "", **renames: str):
    """Build dataclass `cls` from the namespace attributes of the same name (or `renames`)."""
    kwargs = {}
    for f in fields(cls):
        attr = renames.get(f.name, prefix + f.name)
        if hasattr(ns, attr):
            kwargs[f.name] = getattr(ns, attr)
    return cls(**kwargs)


def train_config_from_args(ns: argparse.Namespace) -> TrainConfig:
    """The validated TrainConfig of parsed flags (ValueError names the flag on bad input)."""
    if not ns.hf_checkpoint:
        raise ValueError("--hf-checkpoint is required: the Hugging Face model directory to train")
    from slime.config.resolve import resolve, resolved

    if not resolved(ns):  # a parser of the train flags alone (tools, tests): `auto` decided here
        resolve(ns)
    return TrainConfig(
        hf_checkpoint=ns.hf_checkpoint,
        backend=getattr(ns, "train_backend", "fsdp"),
        ref_load=ns.ref_load,
        device=ns.device,
        seed=ns.seed,
        rollout_temperature=ns.rollout_temperature,
        load=ns.load,
        override_opt_param_scheduler=ns.override_opt_param_scheduler,
        distributed_timeout_minutes=ns.distributed_timeout_minutes,
        save_debug_train_data=getattr(ns, "save_debug_train_data", None),
        check_precision=getattr(ns, "check_precision", False),
        deterministic=getattr(ns, "deterministic_mode", False),
        loss=_pick(LossConfig, ns),
        optimizer=_pick(OptimizerConfig, ns),
        batch=_pick(BatchConfig, ns),
        fsdp=_pick(
            FSDPConfig,
            ns,
            prefix="fsdp_",
            gradient_checkpointing="gradient_checkpointing",
            attn_implementation="attn_implementation",
            disable_sharding="debug_disable_sharding",
        ),
        megatron=_pick(MegatronConfig, ns),
        model=_pick(ModelOptions, ns),
        moe=_pick(MoEOptions, ns),
        opd=opd_config(ns) if hasattr(ns, "use_opd") else OPDConfig(),
        lora=lora_config(ns),
        plugin_args=_plugin_args(ns),
    )


def _plugin_args(ns: argparse.Namespace) -> argparse.Namespace | None:
    hooks = (
        getattr(ns, "custom_tis_function_path", None),
        getattr(ns, "custom_pg_loss_reducer_function_path", None),
    )
    return argparse.Namespace(**vars(ns)) if any(hooks) else None
