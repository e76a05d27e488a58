"""Megatron-LM's flags as slime's launch scripts pass them: the model's architecture and the
training options.

slime trains through Megatron-LM's argument parser, so its scripts carry Megatron-LM's flags
(`scripts/models/<model>.sh`'s MODEL_ARGS, `--optimizer`, `--recompute-*`, ...). Here each one
has an explicit effect, listed in `--help`, in the start-up banner and in
docs/migrating-from-slime.md (generated from `SPECS`):

- `checked`: an architecture flag. The model comes from `--hf-checkpoint`'s config.json; the flag
  must describe the same model (`architecture_problems`), so a script for another model, or a
  typo in one, stops the job before anything starts.
- `applied`: the backend does what the flag says (`TrainConfig.model`, `.optimizer`).
- `no effect`: a speed or memory knob this backend has no counterpart for; it cannot change
  results. The banner lists the ones given.
- `refused`: it describes something not built here (MoE, MLA, FP8, ...); giving it (with any
  value but the neutral one) is exit 2 naming the feature.

Megatron-LM's own defaults are kept, so an absent flag means what it means there: with a model
described (`--num-layers` given), a missing `--swiglu` is a GeLU MLP and a missing
`--untie-embeddings-and-output-weights` ties the embeddings, and both are checked too.
"""

from __future__ import annotations

from typing import Any

from slime.config.surface import APPLIED, CHECKED, NO_EFFECT, REFUSED, Spec, store_true

SLIME_SPECS: dict[tuple[str, str], tuple[str, ...]] = {
    ("slime_plugins.models.glm4", "get_glm_spec"): ("glm4",),
    ("slime_plugins.models.qwen3_next", "get_qwen3_next_spec"): ("qwen3_next",),
    ("slime_plugins.models.qwen3_5", "get_qwen3_5_spec"): (
        "qwen3_5_text",
        "qwen3_5",
        "qwen3_5_moe_text",
        "qwen3_5_moe",
    ),
    ("slime_plugins.models.qwen3_5_vl", "get_qwen3_5_vl_model_provider"): ("qwen3_5", "qwen3_5_moe"),
}
"""slime's layer specs (--spec MODULE FUNCTION) that the flags accept, as the backends build those
layers themselves: the model_types each describes (slime.config.architecture.spec_problems)."""


def _arch(flag: str, kwargs: dict[str, Any], note: str, neutral: Any = None) -> Spec:
    return Spec(flag, kwargs, CHECKED, CHECKED, note, neutral, group="architecture")


def _refused(
    flag: str, kwargs: dict[str, Any], feature: str, neutral: Any = None, group: str = "architecture"
) -> Spec:
    return Spec(flag, kwargs, REFUSED, REFUSED, feature, neutral, group=group)


def _moe_arch(flag: str, kwargs: dict[str, Any], note: str) -> Spec:
    """A mixture-of-experts architecture flag: checked against config.json with either backend."""
    return Spec(flag, kwargs, CHECKED, CHECKED, note, group="architecture")


def _moe(
    flag: str,
    kwargs: dict[str, Any],
    fsdp: str,
    megatron: str,
    note: str,
    neutral: Any = None,
    refused_note: str | None = None,
) -> Spec:
    """A mixture-of-experts training flag."""
    return Spec(flag, kwargs, fsdp, megatron, note, neutral, group="training", refused_note=refused_note)


def _no_effect(flag: str, kwargs: dict[str, Any], note: str) -> Spec:
    return Spec(flag, kwargs, NO_EFFECT, NO_EFFECT, note)


MTP = "fsdp: multi-token prediction modules are built by the Megatron backend only (transformers has none)"
FP8 = "FP8 training is not supported (float32 or bfloat16)"

SPECS: tuple[Spec, ...] = (
    # ---- architecture: checked against --hf-checkpoint's config.json ---------------------------
    _arch("--num-layers", {"type": int}, "config.json num_hidden_layers"),
    _arch("--hidden-size", {"type": int}, "hidden_size"),
    _arch("--ffn-hidden-size", {"type": int}, "intermediate_size"),
    _arch("--num-attention-heads", {"type": int}, "num_attention_heads"),
    _arch("--group-query-attention", store_true(), "num_key_value_heads < num_attention_heads"),
    _arch("--num-query-groups", {"type": int}, "num_key_value_heads (with --group-query-attention)"),
    _arch(
        "--kv-channels",
        {"type": int},
        "head_dim (default hidden_size / num_attention_heads); with --multi-latent-attention, "
        "qk_nope_head_dim",
    ),
    _arch("--vocab-size", {"type": int}, "vocab_size"),
    _arch("--max-position-embeddings", {"type": int}, "max_position_embeddings"),
    _arch(
        "--swiglu", store_true(), "hidden_act silu (gated MLP); absent: GeLU, which no supported model uses"
    ),
    _arch(
        "--normalization",
        {"choices": ["LayerNorm", "RMSNorm"]},
        "RMSNorm for every supported model (Megatron-LM's default is LayerNorm)",
        "RMSNorm",
    ),
    _arch("--norm-epsilon", {"type": float}, "rms_norm_eps (Megatron-LM's default: 1e-5)"),
    _arch(
        "--disable-bias-linear",
        store_true(),
        "no bias in the linear layers (attention_bias / mlp_bias false)",
    ),
    _arch(
        "--add-qkv-bias",
        store_true(),
        "q/k/v projections with bias (Qwen2, attention_bias); not compared with --multi-latent-attention, "
        "whose latent projections have none in Megatron-LM (slime's GLM-4.7-Flash script gives it)",
    ),
    _arch("--qk-layernorm", store_true(), "per-head RMSNorm on queries and keys (Qwen3)"),
    _arch("--untie-embeddings-and-output-weights", store_true(), "tie_word_embeddings false"),
    _arch(
        "--position-embedding-type",
        {"choices": ["learned_absolute", "rope", "none"], "default": None},
        "rope for every supported model (also --use-rotary-position-embeddings)",
        "rope",
    ),
    _arch("--use-rotary-position-embeddings", store_true(), "same as --position-embedding-type rope"),
    _arch(
        "--no-position-embedding",
        store_true(dest="no_position_embedding"),
        "no learned absolute position embedding (RoPE models have none)",
    ),
    _arch("--rotary-base", {"type": float}, "rope_theta (Megatron-LM's default: 10000)"),
    _arch("--rotary-percent", {"type": float}, "partial_rotary_factor (Megatron-LM's default: 1.0)"),
    _arch("--use-rope-scaling", store_true(), "rope_scaling of type llama3 (Llama 3.1 / 3.2)"),
    _arch(
        "--rope-scaling-factor",
        {"type": float, "default": None},
        "rope_scaling.factor with --use-rope-scaling (8)",
    ),
    _arch(
        "--rotary-scaling-factor",
        {"type": float, "default": None},
        "rope_scaling.factor with --use-rope-scaling (slime's Llama scripts pass this one); with "
        "--multi-latent-attention, YaRN's factor (DeepSeek-V3: 40)",
    ),
    _arch(
        "--seq-length",
        {"type": int, "default": None},
        "at most max_position_embeddings; samples are not padded to it (variable-length micro-batches)",
    ),
    _arch("--rotary-interleaved", store_true(), "interleaved rotary pairs (GLM-4: model_type glm4)"),
    _arch("--apply-layernorm-1p", store_true(), "zero-centred (1 + gamma) norms (Qwen3-Next, Qwen3.5)"),
    _arch("--post-self-attn-layernorm", store_true(), "a norm after attention (GLM-4's sandwich norms)"),
    _arch("--post-mlp-layernorm", store_true(), "a norm after the MLP (GLM-4's sandwich norms)"),
    _arch("--attention-output-gate", store_true(), "gated attention output (Qwen3-Next, Qwen3.5)"),
    _arch("--use-gated-attention", store_true(), "gated attention (Qwen3-Next, Qwen3.5)"),
    Spec(
        "--spec",
        {"nargs": "+", "default": None},
        NO_EFFECT,
        REFUSED,
        "a custom Megatron layer spec (--spec MODULE FUNCTION); FSDP builds the model from "
        "--hf-checkpoint's transformers modeling, which the spec describes. slime's specs for GLM-4 "
        "(slime_plugins.models.glm4 get_glm_spec), Qwen3-Next (slime_plugins.models.qwen3_next "
        "get_qwen3_next_spec) and Qwen3.5 (slime_plugins.models.qwen3_5 get_qwen3_5_spec) are accepted by "
        "both backends: the Megatron backend builds those families' layers itself; so is slime's Qwen3.5 "
        "vision-language provider (slime_plugins.models.qwen3_5_vl get_qwen3_5_vl_model_provider): FSDP "
        "builds the released checkpoint's own model, Megatron its language model (prompts without images)",
        neutral=tuple(list(spec) for spec in SLIME_SPECS),
        group="architecture",
        refused_note="custom Megatron layer specs are not supported: the Megatron backend builds "
        "megatron-core's own specs from --hf-checkpoint (and GLM-4's, Qwen3-Next's and "
        "Qwen3.5's for slime's specs of them)",
    ),
    _arch("--multi-latent-attention", store_true(), "multi-latent attention (DeepSeek-V3: kv_lora_rank)"),
    _arch("--q-lora-rank", {"type": int, "default": None}, "q_lora_rank (none: queries without a latent)"),
    _arch("--kv-lora-rank", {"type": int, "default": None}, "kv_lora_rank"),
    _arch("--qk-head-dim", {"type": int, "default": None}, "qk_nope_head_dim"),
    _arch("--qk-pos-emb-head-dim", {"type": int, "default": None}, "qk_rope_head_dim"),
    _arch("--v-head-dim", {"type": int, "default": None}, "v_head_dim"),
    *(
        _arch(f, {"type": float, "default": None}, f"rope_parameters.{key} of YaRN (1.0 otherwise)")
        for f, key in (("--mscale", "mscale"), ("--mscale-all-dim", "mscale_all_dim"))
    ),
    # ---- mixture of experts: checked against config.json with either backend ----
    _moe_arch("--num-experts", {"type": int, "default": None}, "num_experts (none: a dense model)"),
    _moe_arch(
        "--moe-layer-freq",
        {"default": None},
        "which layers are MoE (an int k: every k-th; or a list like [0,1,1]): decoder_sparse_step, "
        "mlp_only_layers",
    ),
    _moe_arch("--moe-ffn-hidden-size", {"type": int, "default": None}, "moe_intermediate_size"),
    _moe_arch(
        "--moe-router-topk", {"type": int, "default": None}, "num_experts_per_tok (Megatron-LM's default 2)"
    ),
    _moe_arch(
        "--moe-shared-expert-intermediate-size",
        {"type": int, "default": None},
        "shared_expert_intermediate_size (none: no shared expert)",
    ),
    _moe_arch("--moe-router-score-function", {"default": None}, "softmax for the Qwen MoE families"),
    _moe_arch(
        "--moe-router-pre-softmax",
        store_true(),
        "softmax before top-k without renormalising: norm_topk_prob false",
    ),
    _moe_arch(
        "--moe-router-topk-scaling-factor",
        {"type": float, "default": None},
        "routed_scaling_factor (none for the Qwen MoE families)",
    ),
    _arch("--moe-router-num-groups", {"type": int, "default": None}, "n_group (DeepSeek-V3's expert groups)"),
    _arch("--moe-router-group-topk", {"type": int, "default": None}, "topk_group (groups kept per token)"),
    _arch(
        "--moe-router-enable-expert-bias",
        store_true(),
        "the routers' expert-score correction bias (e_score_correction_bias: DeepSeek-V3, GLM-4.5+), as the "
        "checkpoint has it",
    ),
    _moe(
        "--moe-router-bias-update-rate",
        {"type": float, "default": 0.0},
        APPLIED,
        APPLIED,
        "aux-loss-free balancing: after each optimizer step every router's expert bias moves by this rate "
        "towards the experts that got fewer than the mean of the step's real training tokens (all ranks "
        "counted), as megatron-core updates it; only for routers with an expert bias (DeepSeek-V3, "
        "GLM-4.5+, GLM-4.7-Flash). 0: the bias stays as the checkpoint has it (slime's scripts)",
        neutral=0.0,
    ),
    _moe_arch(
        "--moe-shared-expert-gate",
        store_true(),
        "a sigmoid gate on the shared expert (Qwen3-Next, Qwen3.5-MoE)",
    ),
    _moe(
        "--moe-aux-loss-coeff",
        {"type": float, "default": 0.0},
        APPLIED,
        APPLIED,
        "the load-balancing loss, megatron-core's aux_loss per MoE layer and micro-batch, added to the "
        "loss times this (0: off, as in slime's RL scripts)",
        neutral=0.0,
    ),
    _moe(
        "--moe-router-load-balancing-type",
        {"choices": ["aux_loss", "seq_aux_loss", "none"], "default": None},
        APPLIED,
        APPLIED,
        "aux_loss (megatron-core's, over each micro-batch's tokens), seq_aux_loss (megatron-core's "
        "per-sequence loss: each sequence's own, averaged over the step's sequences) or none (no "
        "load-balancing loss whatever --moe-aux-loss-coeff says)",
    ),
    _moe(
        "--moe-router-dtype",
        {"choices": ["fp32", "fp64"], "default": None},
        APPLIED,
        APPLIED,
        "the router's logits, softmax and top-k in this precision (default: the parameters' dtype for the "
        "logits, float32 for the softmax, as Hugging Face does; megatron: megatron-core's moe_router_dtype)",
    ),
    *(
        _moe(
            f,
            kwargs,
            NO_EFFECT,
            NO_EFFECT,
            "a speed knob of megatron-core's MoE layer (results are the same)",
        )
        for f, kwargs in (
            # megatron: always alltoall (megatron-core's only dispatcher for variable-length micro-batches)
            ("--moe-token-dispatcher-type", {"default": None}),
            # megatron: SequentialMLP; Transformer Engine's grouped GEMM is not wired in yet (docs/moe.md)
            ("--moe-grouped-gemm", store_true()),
            ("--moe-permute-fusion", store_true()),
            ("--moe-enable-deepep", store_true()),
        )
    ),
    _moe(
        "--moe-token-drop-policy",
        {"default": None},
        NO_EFFECT,
        NO_EFFECT,
        "dropless routing here (no --moe-expert-capacity-factor), so no token is dropped",
    ),
    Spec(
        "--expert-tensor-parallel-size",
        {"type": int, "default": None},
        NO_EFFECT,
        APPLIED,
        "megatron: each expert split over this many ranks (default: the tensor-parallel size, as "
        "Megatron-LM); FSDP shards each MoE layer's experts over the ranks instead",
        neutral=1,
        group="training",
    ),
    Spec(
        "--mtp-num-layers",
        {"type": int, "default": None},
        REFUSED,
        APPLIED,
        "megatron: build the checkpoint's first N multi-token prediction modules "
        "(num_nextn_predict_layers: DeepSeek-V3, GLM-4.5+, GLM-4.7-Flash); saved and exported with the "
        "model, left out of the weight push",
        neutral=0,
        group="training",
        refused_note=MTP,
    ),
    Spec(
        "--mtp-loss-scaling-factor",
        {"type": float, "default": 0.2},
        REFUSED,
        APPLIED,
        "megatron: the MTP loss's weight, divided by the modules' count (slime's default 0.2)",
        neutral=0.2,
        group="training",
        refused_note=MTP,
    ),
    Spec(
        "--enable-mtp-training",
        store_true(),
        REFUSED,
        APPLIED,
        "megatron: train the MTP modules (cross entropy of token i + k + 1 on the response tokens, "
        "averaged as slime does); without it they are kept as loaded",
        group="training",
        refused_note=MTP,
    ),
    # ---- training ----------------------------------------------------------------------------
    Spec(
        "--optimizer",
        {"choices": ["adam", "sgd"], "default": "adam"},
        APPLIED,
        APPLIED,
        "adam: AdamW (decoupled weight decay, as Megatron-LM's adam); sgd: SGD with --sgd-momentum",
    ),
    Spec("--sgd-momentum", {"type": float, "default": 0.9}, APPLIED, APPLIED, "momentum of --optimizer sgd"),
    Spec(
        "--lr-warmup-fraction",
        {"type": float, "default": None},
        APPLIED,
        APPLIED,
        "warm-up steps = fraction x the decay steps (--lr-decay-iters, else the run's optimizer steps)",
    ),
    Spec(
        "--attention-dropout",
        {"type": float, "default": 0.0},
        APPLIED,
        APPLIED,
        "dropout on attention probabilities in training steps (0 here and in slime; Megatron-LM's default "
        "is 0.1); log-prob passes run without dropout",
    ),
    Spec(
        "--hidden-dropout",
        {"type": float, "default": 0.0},
        REFUSED,
        APPLIED,
        "dropout after attention and MLP in training steps (0 by default); the Hugging Face Llama/Qwen "
        "modules the FSDP backend trains have no such dropout, so a non-zero value is refused there",
        neutral=0.0,
    ),
    Spec(
        "--attention-softmax-in-fp32",
        store_true(),
        NO_EFFECT,
        APPLIED,
        "megatron: the attention softmax runs in float32 under --bf16; FSDP: Hugging Face attention already "
        "computes it in float32 (eager) or accumulates in float32 (SDPA kernels)",
    ),
    Spec(
        "--accumulate-allreduce-grads-in-fp32",
        store_true(),
        APPLIED,
        APPLIED,
        "always on here: gradients accumulate and reduce in float32 (megatron --bf16: float32 main grads; "
        "FSDP: --fsdp-reduce-dtype float32, which this flag requires)",
    ),
    Spec(
        "--recompute-granularity",
        {"choices": ["full", "selective"], "default": None},
        APPLIED,
        APPLIED,
        "megatron: megatron-core's recompute; FSDP: full = --gradient-checkpointing (every layer), "
        "selective has no counterpart and no effect",
    ),
    Spec(
        "--recompute-method",
        {"choices": ["uniform", "block"], "default": None},
        NO_EFFECT,
        APPLIED,
        "megatron-core's recompute method (with --recompute-granularity full)",
    ),
    Spec(
        "--recompute-num-layers",
        {"type": int, "default": None},
        NO_EFFECT,
        APPLIED,
        "megatron-core's layers per recompute chunk (uniform) or recomputed layers (block)",
    ),
    _no_effect(
        "--attention-backend",
        {"choices": ["flash", "fused", "unfused", "local", "auto"], "default": None},
        "the attention kernel (FSDP: --attn-implementation; megatron: the layer spec's attention)",
    ),
    _no_effect(
        "--use-distributed-optimizer",
        store_true(),
        "optimizer-state sharding: FSDP shards it always; megatron keeps one copy per data-parallel replica",
    ),
    _no_effect("--optimizer-cpu-offload", store_true(), "optimizer states in CPU memory (memory only)"),
    _no_effect("--overlap-cpu-optimizer-d2h-h2d", store_true(), "overlap of the CPU optimizer's copies"),
    _no_effect(
        "--use-precision-aware-optimizer",
        store_true(),
        "Transformer Engine's fused optimizer (same float32 states; speed only)",
    ),
    _no_effect(
        "--no-gradient-accumulation-fusion",
        store_true(dest="no_gradient_accumulation_fusion"),
        "kernel fusion (off here: plain torch)",
    ),
    _no_effect("--no-masked-softmax-fusion", store_true(), "kernel fusion (off here: plain torch)"),
    _no_effect("--no-rope-fusion", store_true(), "kernel fusion (off here: plain torch)"),
    _no_effect("--no-bias-swiglu-fusion", store_true(), "kernel fusion (off here: plain torch)"),
    _no_effect("--no-bias-dropout-fusion", store_true(), "kernel fusion (off here: plain torch)"),
    _no_effect(
        "--cross-entropy-loss-fusion", store_true(), "kernel fusion (log-probs are computed by slime)"
    ),
    _no_effect(
        "--no-check-for-nan-in-loss-and-grad",
        store_true(),
        "Megatron-LM's NaN check; here a non-finite loss or gradient norm is reported in the step metrics",
    ),
    *(
        Spec(
            f,
            {"type": int, "default": None},
            NO_EFFECT,
            APPLIED,
            "megatron: the layers of the first / last pipeline stage, the other stages splitting the rest "
            "evenly (uneven stages); FSDP has no pipeline stages",
            group="training",
        )
        for f in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers")
    ),
    _refused("--fp8-format", {"default": None}, FP8, group="training"),
    _refused("--fp8-recipe", {"default": None}, FP8, group="training"),
    _refused("--fp8-param-gather", store_true(), FP8, group="training"),
    _refused(
        "--main-params-dtype",
        {"default": None},
        "optimizer dtypes other than float32 are not supported",
        neutral="fp32",
        group="training",
    ),
    _refused(
        "--exp-avg-dtype",
        {"default": None},
        "optimizer dtypes other than float32 are not supported",
        neutral="fp32",
        group="training",
    ),
    _refused(
        "--exp-avg-sq-dtype",
        {"default": None},
        "optimizer dtypes other than float32 are not supported",
        neutral="fp32",
        group="training",
    ),
)

GROUPS = {
    "architecture": "Megatron-LM model architecture (checked against --hf-checkpoint's config.json)",
    "training": "Megatron-LM training flags (effect per train backend)",
}
