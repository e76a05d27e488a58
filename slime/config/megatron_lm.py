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

import argparse
import math
from dataclasses import dataclass, field
from typing import Any

from slime.config.surface import APPLIED, CHECKED, NO_EFFECT, REFUSED, Spec, given, store_true


def _arch(flag: str, kwargs: dict[str, Any], note: str, neutral: Any = None) -> Spec:
    return Spec(flag, kwargs, CHECKED, CHECKED, note, neutral, group="architecture")


def _refused(
    flag: str, kwargs: dict[str, Any], feature: str, neutral: Any = None, group: str = "architecture"
) -> Spec:
    return Spec(flag, kwargs, REFUSED, REFUSED, feature, neutral, group=group)


def _no_effect(flag: str, kwargs: dict[str, Any], note: str) -> Spec:
    return Spec(flag, kwargs, NO_EFFECT, NO_EFFECT, note)


MOE = "mixture-of-experts models are not supported yet (dense Qwen2/Qwen3/Llama only)"
MLA = "multi-latent attention (DeepSeek/Kimi) is not supported (dense Qwen2/Qwen3/Llama only)"
MTP = "multi-token prediction layers are not supported"
FP8 = "FP8 training is not supported (float32 or bfloat16)"

SPECS: tuple[Spec, ...] = (
    # ---- architecture: checked against --hf-checkpoint's config.json ---------------------------
    _arch("--num-layers", {"type": int}, "config.json num_hidden_layers"),
    _arch("--hidden-size", {"type": int}, "hidden_size"),
    _arch("--ffn-hidden-size", {"type": int}, "intermediate_size"),
    _arch("--num-attention-heads", {"type": int}, "num_attention_heads"),
    _arch("--group-query-attention", store_true(), "num_key_value_heads < num_attention_heads"),
    _arch("--num-query-groups", {"type": int}, "num_key_value_heads (with --group-query-attention)"),
    _arch("--kv-channels", {"type": int}, "head_dim (default hidden_size / num_attention_heads)"),
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
    _arch("--add-qkv-bias", store_true(), "q/k/v projections with bias (Qwen2, attention_bias)"),
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
        "rope_scaling.factor with --use-rope-scaling (slime's Llama scripts pass this one)",
    ),
    _arch(
        "--seq-length",
        {"type": int, "default": None},
        "at most max_position_embeddings; samples are not padded to it (variable-length micro-batches)",
    ),
    _refused(
        "--rotary-interleaved",
        store_true(),
        "interleaved rotary embeddings (GLM-4) are not supported: the supported models rotate halves",
    ),
    _refused("--apply-layernorm-1p", store_true(), "zero-centred (1 + gamma) norms are not supported"),
    _refused("--post-self-attn-layernorm", store_true(), "sandwich norms (GLM-4) are not supported"),
    _refused("--post-mlp-layernorm", store_true(), "sandwich norms (GLM-4) are not supported"),
    _refused(
        "--attention-output-gate", store_true(), "gated attention (Qwen3-Next / Qwen3.5) is not supported"
    ),
    _refused(
        "--use-gated-attention", store_true(), "gated attention (Qwen3-Next / Qwen3.5) is not supported"
    ),
    _refused(
        "--spec",
        {"nargs": "+", "default": None},
        "custom Megatron layer specs (--spec MODULE FUNCTION) are "
        "not supported: the model is built from --hf-checkpoint with megatron-core's own specs",
    ),
    _refused("--multi-latent-attention", store_true(), MLA),
    *(
        _refused(f, {"type": int, "default": None}, MLA)
        for f in ("--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim")
    ),
    *(_refused(f, {"type": float, "default": None}, MLA) for f in ("--mscale", "--mscale-all-dim")),
    _refused("--num-experts", {"type": int, "default": None}, MOE),
    _refused("--moe-layer-freq", {"default": None}, MOE),
    *(
        _refused(f, {"type": int, "default": None}, MOE)
        for f in (
            "--moe-ffn-hidden-size",
            "--moe-router-topk",
            "--moe-shared-expert-intermediate-size",
            "--moe-router-num-groups",
            "--moe-router-group-topk",
        )
    ),
    *(
        _refused(f, {"type": float, "default": None}, MOE)
        for f in ("--moe-aux-loss-coeff", "--moe-router-topk-scaling-factor", "--moe-router-bias-update-rate")
    ),
    *(
        _refused(f, {"default": None}, MOE)
        for f in (
            "--moe-router-score-function",
            "--moe-router-dtype",
            "--moe-router-load-balancing-type",
            "--moe-token-dispatcher-type",
            "--moe-token-drop-policy",
        )
    ),
    *(
        _refused(f, store_true(), MOE)
        for f in (
            "--moe-grouped-gemm",
            "--moe-router-enable-expert-bias",
            "--moe-router-pre-softmax",
            "--moe-shared-expert-gate",
            "--moe-enable-deepep",
            "--moe-permute-fusion",
        )
    ),
    _refused("--expert-tensor-parallel-size", {"type": int, "default": 1}, MOE, neutral=1, group="training"),
    _refused("--mtp-num-layers", {"type": int, "default": None}, MTP, neutral=0),
    _refused("--mtp-loss-scaling-factor", {"type": float, "default": None}, MTP),
    _refused("--enable-mtp-training", store_true(), MTP),
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
        "dropout on attention probabilities in training steps (0 here and in slime; Megatron-LM's default is 0.1); "
        "log-prob passes run without dropout",
    ),
    Spec(
        "--hidden-dropout",
        {"type": float, "default": 0.0},
        REFUSED,
        APPLIED,
        "dropout after attention and MLP in training steps (0 by default); the Hugging Face Llama/Qwen modules "
        "the FSDP backend trains have no such dropout, so a non-zero value is refused there",
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
        "always on here: gradients accumulate and reduce in float32 (megatron --bf16: float32 main grads; FSDP: "
        "--fsdp-reduce-dtype float32, which this flag requires)",
    ),
    Spec(
        "--recompute-granularity",
        {"choices": ["full", "selective"], "default": None},
        APPLIED,
        APPLIED,
        "megatron: megatron-core's recompute; FSDP: full = --gradient-checkpointing (every layer), selective has "
        "no counterpart and no effect",
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
    _refused(
        "--decoder-first-pipeline-num-layers",
        {"type": int, "default": None},
        "uneven pipeline stages are not supported: every stage holds num_layers / PP layers",
        group="training",
    ),
    _refused(
        "--decoder-last-pipeline-num-layers",
        {"type": int, "default": None},
        "uneven pipeline stages are not supported: every stage holds num_layers / PP layers",
        group="training",
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


def count_architecture_flags(ns: argparse.Namespace) -> int:
    """How many architecture flags were given (for the plan)."""
    return sum(given(ns, s) for s in SPECS if s.group == "architecture" and s.fsdp == CHECKED)


def model_described(ns: argparse.Namespace) -> bool:
    return any(getattr(ns, d) is not None for d in ("num_layers", "hidden_size", "num_attention_heads"))


# ---- the HF config in Megatron-LM's terms ---------------------------------------------------


@dataclass(frozen=True)
class HFArchitecture:
    """An HF config's model in Megatron-LM's flag values (dest -> value), and where each came
    from (dest -> config key) for the messages."""

    values: dict[str, Any]
    keys: dict[str, str] = field(default_factory=dict)


def rope_scaling(config: Any) -> tuple[str, float | None, float]:
    """An HF config's RoPE: (rope type, scaling factor or None, rotary base), from
    `rope_parameters` (transformers 5) or `rope_scaling` and `rope_theta` (before)."""
    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict):
        params = {
            **(getattr(config, "rope_scaling", None) or {}),
            "rope_theta": getattr(config, "rope_theta", None),
        }
    kind = params.get("rope_type", params.get("type")) or "default"
    theta = params.get("rope_theta")
    return kind, params.get("factor"), float(theta) if theta is not None else 10000.0


def hf_architecture(config: Any) -> HFArchitecture:
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    model_type = getattr(config, "model_type", "")
    attention_bias = bool(getattr(config, "attention_bias", False))
    scaling_kind, factor, theta = rope_scaling(config)
    values = {
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "ffn_hidden_size": getattr(config, "intermediate_size", None),
        "num_attention_heads": heads,
        "group_query_attention": kv != heads,
        "num_query_groups": kv,
        "kv_channels": head_dim,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": getattr(config, "max_position_embeddings", None),
        "swiglu": getattr(config, "hidden_act", None) == "silu",
        "normalization": "RMSNorm" if hasattr(config, "rms_norm_eps") else "LayerNorm",
        "norm_epsilon": getattr(config, "rms_norm_eps", None) or getattr(config, "layer_norm_eps", None),
        "add_bias_linear": attention_bias or bool(getattr(config, "mlp_bias", False)),
        "add_qkv_bias": model_type == "qwen2" or attention_bias,
        "qk_layernorm": model_type in ("qwen3",),
        "untie_embeddings_and_output_weights": not getattr(config, "tie_word_embeddings", False),
        "position_embedding_type": "rope",
        "rotary_base": theta,
        "rotary_percent": float(getattr(config, "partial_rotary_factor", 1.0) or 1.0),
        "use_rope_scaling": scaling_kind == "llama3",
        "rope_scaling_factor": factor,
    }
    keys = {
        "num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "ffn_hidden_size": "intermediate_size",
        "num_attention_heads": "num_attention_heads", "group_query_attention": "num_key_value_heads",
        "num_query_groups": "num_key_value_heads", "kv_channels": "head_dim", "vocab_size": "vocab_size",
        "max_position_embeddings": "max_position_embeddings", "swiglu": "hidden_act",
        "normalization": "rms_norm_eps", "norm_epsilon": "rms_norm_eps", "add_bias_linear": "attention_bias/mlp_bias",
        "add_qkv_bias": "model_type/attention_bias", "qk_layernorm": "model_type",
        "untie_embeddings_and_output_weights": "tie_word_embeddings", "rotary_base": "rope_theta",
        "rotary_percent": "partial_rotary_factor", "use_rope_scaling": "rope_scaling.rope_type",
        "rope_scaling_factor": "rope_scaling.factor",
    }  # fmt: skip
    return HFArchitecture(values, keys)


def megatron_architecture(ns: argparse.Namespace) -> dict[str, Any]:
    """The model the flags describe, in Megatron-LM's meaning (its defaults for what is absent).
    Only keys with a definite value are returned: a size not given is not compared."""
    out: dict[str, Any] = {}
    for dest in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
                 "max_position_embeddings", "kv_channels"):  # fmt: skip
        if getattr(ns, dest) is not None:
            out[dest] = getattr(ns, dest)
    if ns.num_attention_heads is not None:
        gqa = bool(ns.group_query_attention)
        out["group_query_attention"] = gqa
        if gqa and ns.num_query_groups is not None:
            out["num_query_groups"] = ns.num_query_groups
        elif not gqa:
            out["num_query_groups"] = ns.num_attention_heads  # Megatron-LM: MHA without the flag
    if not model_described(ns):
        # Only what was given: the booleans' defaults mean something only for a whole model.
        for dest in ("norm_epsilon", "rotary_base", "rotary_percent"):
            if getattr(ns, dest) is not None:
                out[dest] = getattr(ns, dest)
        return out
    out["swiglu"] = bool(ns.swiglu)
    out["normalization"] = ns.normalization or "LayerNorm"
    out["norm_epsilon"] = 1e-5 if ns.norm_epsilon is None else ns.norm_epsilon
    out["add_bias_linear"] = not ns.disable_bias_linear
    out["add_qkv_bias"] = bool(ns.add_qkv_bias) or not ns.disable_bias_linear
    out["qk_layernorm"] = bool(ns.qk_layernorm)
    out["untie_embeddings_and_output_weights"] = bool(ns.untie_embeddings_and_output_weights)
    rope = ns.use_rotary_position_embeddings or ns.position_embedding_type == "rope"
    out["position_embedding_type"] = "rope" if rope else ns.position_embedding_type or "learned_absolute"
    out["rotary_base"] = 10000.0 if ns.rotary_base is None else ns.rotary_base
    out["rotary_percent"] = 1.0 if ns.rotary_percent is None else ns.rotary_percent
    out["use_rope_scaling"] = bool(ns.use_rope_scaling)
    if ns.use_rope_scaling:
        out["rope_scaling_factor"] = next(
            (v for v in (ns.rope_scaling_factor, ns.rotary_scaling_factor) if v is not None), 8.0
        )
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=1e-6)
    return a == b


def _flag_text(dest: str, value: Any, ns: argparse.Namespace) -> str:
    """How the flags said it, for a message."""
    booleans = {
        "swiglu": "--swiglu", "add_qkv_bias": "--add-qkv-bias", "qk_layernorm": "--qk-layernorm",
        "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
        "group_query_attention": "--group-query-attention", "use_rope_scaling": "--use-rope-scaling",
        "add_bias_linear": "--disable-bias-linear",
    }  # fmt: skip
    if dest == "add_bias_linear":
        return "no --disable-bias-linear (biases on)" if value else "--disable-bias-linear"
    if dest in booleans:
        return booleans[dest] if value else f"no {booleans[dest]} (Megatron-LM's default: off)"
    if dest == "num_query_groups" and not ns.group_query_attention:
        return f"no --group-query-attention (one key/value head per query head: {value})"
    if dest == "position_embedding_type":
        return f"--position-embedding-type {value}" + (" (Megatron-LM's default)" if value != "rope" else "")
    if dest == "rope_scaling_factor":
        given = "--rope-scaling-factor" if ns.rope_scaling_factor is not None else "--rotary-scaling-factor"
        return f"{given} {value}"
    flag = "--" + dest.replace("_", "-")
    if getattr(ns, dest, None) is None:
        return f"{flag} {value} (Megatron-LM's default)"
    return f"{flag} {value}"


def architecture_problems(ns: argparse.Namespace, config: Any, where: str) -> list[str]:
    """Every architecture flag (or Megatron-LM default, for a described model) that disagrees
    with the HF config, one message each naming the flag, its value, the config key and its value."""
    hf = hf_architecture(config)
    out = []
    for dest, value in megatron_architecture(ns).items():
        theirs = hf.values.get(dest)
        if theirs is None or _same(value, theirs):
            continue
        key = hf.keys.get(dest, dest)
        shown = theirs
        if dest == "swiglu":
            shown = getattr(config, "hidden_act", None)
        elif dest == "untie_embeddings_and_output_weights":
            shown = getattr(config, "tie_word_embeddings", False)
        elif dest == "use_rope_scaling":
            shown = rope_scaling(config)[0]
        elif dest in ("qk_layernorm", "add_qkv_bias"):
            shown = f"{getattr(config, 'model_type', '?')} (attention_bias={getattr(config, 'attention_bias', None)})"
        out.append(f"{_flag_text(dest, value, ns)} disagrees with {where}: config.json {key} = {shown}")
    limit = hf.values["max_position_embeddings"]
    if ns.seq_length is not None and limit is not None and ns.seq_length > limit:
        out.append(f"--seq-length {ns.seq_length} is longer than {where}'s max_position_embeddings {limit}")
    if ns.rotary_scaling_factor not in (None, 1.0) and not ns.use_rope_scaling:
        out.append(
            f"--rotary-scaling-factor {ns.rotary_scaling_factor} without --use-rope-scaling: scaled RoPE other than "
            "Llama 3's (YaRN, linear) is not supported"
        )
    return out
