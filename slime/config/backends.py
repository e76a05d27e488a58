"""The two train backends' own settings: `FSDPConfig` (sharding, precision, memory of the FSDP2
actor) and `MegatronConfig` (megatron-core's parallelism and options), each filled from its
flags (slime.config.train adds them to `TrainConfig`). No torch import here."""

from __future__ import annotations

from dataclasses import dataclass

from slime.config.flags import flag

DTYPES = ("float32", "bfloat16", "float16")
FSDP_ONLY = (
    "--debug-disable-sharding",
    "--fsdp-cpu-offload",
    "--fsdp-param-dtype",
    "--fsdp-reduce-dtype",
    "--fsdp-torch-compile",
    "--train-vision-model",
)
"""The flags that configure the FSDP backend alone: refused with --train-backend megatron
(slime.config.checks), and so in the flag table (slime.tools.flag_table)."""


@dataclass(frozen=True)
class FSDPConfig:
    """Sharding, precision and memory options of the FSDP2 backend."""

    param_dtype: str = flag("--fsdp-param-dtype", "float32", choices=DTYPES)
    """`--fsdp-param-dtype`: the gathered parameters' dtype (masters and optimizer states: float32)."""
    reduce_dtype: str = flag("--fsdp-reduce-dtype", "float32", choices=DTYPES)
    """`--fsdp-reduce-dtype`: dtype of the gradient reduce-scatter."""
    cpu_offload: bool = flag("--fsdp-cpu-offload", False)
    """`--fsdp-cpu-offload`: sharded parameters, gradients and optimizer states in CPU memory."""
    gradient_checkpointing: bool = flag("--gradient-checkpointing", False)
    """recompute each decoder layer's activations in backward (FSDP: Hugging Face's checkpointing;
    Megatron: megatron-core's full recompute)"""
    torch_compile: bool = flag("--fsdp-torch-compile", False)
    """`--fsdp-torch-compile`: each decoder layer's forward (and so its backward) through
    torch.compile, the compiled graphs shared by the layers of a class (slime.backends.fsdp.compiled)"""
    attn_implementation: str = flag("--attn-implementation", "sdpa")
    """`--attn-implementation`: Hugging Face attention kernel (sdpa, eager, flash_attention_2)."""
    disable_sharding: bool = flag("--debug-disable-sharding", False)
    """one train rank running the plain module (no fully_shard: plain tensors, no FSDP hooks), to
    step through the model in a debugger"""
    train_vision_model: bool = flag("--train-vision-model", False)
    """vision-language models: train the vision tower too (default: frozen, the language model
    trains)"""

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

    tensor_model_parallel_size: int = flag("--tensor-model-parallel-size", 1)
    """Megatron: ranks each layer's matrices are split over (TP)."""
    pipeline_model_parallel_size: int = flag("--pipeline-model-parallel-size", 1)
    """Megatron: stages the layers are split into (PP)."""
    context_parallel_size: int = flag("--context-parallel-size", 1)
    """Megatron: ranks each sequence is split over (CP)."""
    expert_model_parallel_size: int = flag("--expert-model-parallel-size", 1)
    """Megatron: ranks the experts of an MoE layer are spread over (EP)."""
    expert_tensor_parallel_size: int | None = None
    """Megatron-LM's default: None, the tensor-parallel size."""
    sequence_parallel: bool = flag("--sequence-parallel", False)
    """Megatron: with TP, the activations outside attention and MLP split along the sequence too."""
    make_vocab_size_divisible_by: int = flag("--make-vocab-size-divisible-by", 128)
    """pad the vocabulary to a multiple of this x TP"""
    transformer_impl: str = "local"
    """`local` (megatron-core's layer spec) or `transformer_engine`."""
    decoder_first_pipeline_num_layers: int | None = None
    """`--decoder-first-pipeline-num-layers`: the first pipeline stage's layers (None: an even split)."""
    decoder_last_pipeline_num_layers: int | None = None
    """`--decoder-last-pipeline-num-layers`: the last pipeline stage's layers (None: an even split)."""
    bf16: bool = flag("--bf16", False)
    """bfloat16 parameters and activations, float32 master weights, gradient reductions and
    optimizer states (megatron's mixed precision)"""
    mtp_num_layers: int | None = None
    """`--mtp-num-layers`: the checkpoint's multi-token prediction modules to build (None: none)."""
    mtp_loss_scaling_factor: float = 0.2
    """`--mtp-loss-scaling-factor`: the MTP loss's weight (divided by the modules' count)."""
    enable_mtp_training: bool = False
    """`--enable-mtp-training`: train the MTP modules (else they are kept as loaded)."""

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def stage_layers(self) -> tuple[int | None, int | None]:
        """The first and last pipeline stage's layers (uneven stages; None: as the others)."""
        return self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers

    def __post_init__(self) -> None:
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
            "make_vocab_size_divisible_by",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.expert_tensor_parallel_size is not None and self.expert_tensor_parallel_size < 1:
            raise ValueError(
                f"--expert-tensor-parallel-size must be >= 1, got {self.expert_tensor_parallel_size}"
            )
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            value = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.mtp_num_layers is not None and self.mtp_num_layers < 0:
            raise ValueError(f"--mtp-num-layers must be >= 0, got {self.mtp_num_layers}")
        if self.enable_mtp_training and not self.mtp_num_layers:
            raise ValueError(
                "--enable-mtp-training trains the MTP modules: give --mtp-num-layers N (N >= 1) too"
            )
        if not self.mtp_loss_scaling_factor >= 0:
            raise ValueError(f"--mtp-loss-scaling-factor must be >= 0, got {self.mtp_loss_scaling_factor}")
        if self.transformer_impl not in ("local", "transformer_engine"):
            raise ValueError(
                f"--transformer-impl must be local or transformer_engine, got {self.transformer_impl!r}"
            )
