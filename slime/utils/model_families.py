"""The model families this project runs, what runs each and what their layers are: one registry
the engine, the train backends (FSDP, and Megatron's conversion), the flag checks and
docs/models.md read (a test keeps the table equal to it).

A family is transformers' `model_type` (the key of config.json). Where a piece is not built for
a family, `megatron` holds the reason it is refused, which the Megatron backend prints. A
family's layer traits are what its config.json does not say (the config gives the shapes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BATCHED, PER_SEQUENCE = "batched", "per-sequence"


@dataclass(frozen=True)
class Family:
    model_type: str
    arch: str
    """`make_tiny_model --arch` that writes a tiny checkpoint of it."""
    models: str
    """The released models of this shape (for the docs)."""
    engine: str
    """The torch engine's runner: BATCHED (padded batches, KV cache, CUDA graphs) or PER_SEQUENCE
    (transformers' own forward and cache, one sequence at a time: any layer kind, slower)."""
    megatron: str | None = None
    """None: the Megatron backend builds it (and converts HF <-> Megatron); else why it is refused."""
    megatron_scope: str = ""
    """What of a built family the Megatron backend takes (none: all of it), for the table."""
    router_hooks: bool = False
    """The train backends hook the routers (mixture-of-experts families, softmax and sigmoid
    routers alike): --use-routing-replay, --use-rollout-routing-replay, --moe-aux-loss-coeff and
    --moe-router-dtype act; without them those flags are refused."""
    router_fp32: bool = False
    """transformers' modeling computes the router's logits in float32 whatever the parameters'
    dtype (so --moe-router-dtype fp32 asks for what happens anyway)."""
    hybrid: bool = False
    """Gated delta-net (linear attention) layers beside gated full attention, with zero-centred
    norms (Qwen3-Next, Qwen3.5). transformers' gated delta-net keeps packed samples apart only
    with the flash-linear-attention kernels (CUDA), so FSDP trains these families on padded rows,
    one sample per row (`packs`); the Megatron actor packs them
    (slime.backends.megatron.linear_attention runs each packed sequence apart)."""
    qkv_bias: bool = False
    """q, k and v projections with a bias whatever attention_bias says (Qwen2)."""
    qk_norm: bool = False
    """A per-head RMSNorm on q and k (Qwen3, the hybrid families)."""
    bias_on_qkv_only: bool = False
    """attention_bias gives q, k and v a bias and no other layer (GLM-4, GLM-4.5+)."""
    output_bias: bool = False
    """attention_bias gives the attention's output projection a bias too (Llama, the hybrid
    families), which the Megatron conversion does not take (refused)."""
    glm_layers: bool = False
    """GLM-4's layers: interleaved partial rotary, sandwich norms after attention and MLP, the
    MLP's gate and up stored as one tensor."""
    expert_bias: bool = False
    """Sigmoid routers with an expert bias (DeepSeek-V3, GLM-4.5+, GLM-4.7-Flash)."""
    shared_expert: bool = False
    """A gated shared expert beside the softmax-routed ones (Qwen3-Next, Qwen3.5-MoE)."""
    fused_experts: bool = False
    """transformers fuses the experts of a layer into `mlp.experts.gate_up_proj` / `down_proj`
    (slime.utils.hf_experts maps them to the per-expert checkpoint names)."""
    vision: bool = False
    """A vision-language model (transformers' *ForConditionalGeneration: a vision tower before
    the language model): images in prompts (--multimodal-keys, the engine's `image_data`), built
    with AutoModelForImageTextToText."""
    text_model: str | None = None
    """A vision-language family's language model as a family of its own (its model_type): the
    Megatron backend builds it from the released checkpoint (`language_name`, `text_config`), and
    `python -m slime.tools.text_model extract` writes it as a checkpoint of its own."""

    @property
    def packs(self) -> bool:
        """Packed micro-batches (several samples in one row) in the FSDP actor (see `hybrid`)."""
        return not self.hybrid


VISION_ON_FSDP = (
    "vision-language models train with --train-backend fsdp (the vision tower is not converted to Megatron)"
)

LANGUAGE_MODEL_ONLY = (
    "its language model, read from and written to the released checkpoint (the vision tower stays "
    "as loaded; prompts without images)"
)

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("qwen2", "qwen2", "Qwen2, Qwen2.5", BATCHED, qkv_bias=True),
        Family("qwen3", "qwen3", "Qwen3 dense", BATCHED, qk_norm=True),
        Family("llama", "", "Llama 2 / 3", BATCHED, output_bias=True),
        Family("mistral", "", "Mistral", BATCHED, megatron="Mistral is not converted to Megatron"),
        Family(
            "qwen3_moe",
            "qwen3_moe",
            "Qwen3-30B-A3B, Qwen3-235B-A22B",
            BATCHED,
            router_hooks=True,
            fused_experts=True,
            qk_norm=True,
        ),
        Family(
            "glm4",
            "glm4",
            "GLM-4-0414 (9B, 32B)",
            BATCHED,
            glm_layers=True,
            bias_on_qkv_only=True,
        ),
        Family(
            "glm4_moe",
            "glm4_moe",
            "GLM-4.5, GLM-4.6, GLM-4.7 (355B-A32B, Air)",
            BATCHED,
            bias_on_qkv_only=True,
            expert_bias=True,
            router_hooks=True,
            fused_experts=True,
            router_fp32=True,
        ),
        Family(
            "deepseek_v3",
            "deepseek_v3",
            "DeepSeek-V3 / R1, Kimi-K2, Moonlight",
            BATCHED,
            expert_bias=True,
            router_hooks=True,
            fused_experts=True,
            router_fp32=True,
        ),
        Family(
            "glm4_moe_lite",
            "glm4_moe_lite",
            "GLM-4.7-Flash (30B-A3B)",
            BATCHED,
            expert_bias=True,
            router_hooks=True,
            fused_experts=True,
            router_fp32=True,
        ),
        Family(
            "qwen3_next",
            "qwen3_next",
            "Qwen3-Next-80B-A3B",
            BATCHED,
            router_hooks=True,
            fused_experts=True,
            hybrid=True,
            qk_norm=True,
            output_bias=True,
            shared_expert=True,
        ),
        Family(
            "qwen3_5_text",
            "qwen3_5",
            "Qwen3.5 dense, its text model",
            BATCHED,
            hybrid=True,
            qk_norm=True,
            output_bias=True,
        ),
        Family(
            "qwen3_5_moe_text",
            "qwen3_5_moe",
            "Qwen3.5 MoE, its text model",
            BATCHED,
            router_hooks=True,
            fused_experts=True,
            hybrid=True,
            qk_norm=True,
            output_bias=True,
            shared_expert=True,
        ),
        Family(
            "qwen3_vl",
            "qwen3_vl",
            "Qwen3-VL dense (2B-32B)",
            BATCHED,
            megatron=VISION_ON_FSDP,
            vision=True,
        ),
        Family(
            "qwen3_5",
            "qwen3_5_vl",
            "Qwen3.5 dense as released (0.8B-27B: the vision-language model)",
            BATCHED,
            megatron_scope=LANGUAGE_MODEL_ONLY,
            hybrid=True,
            qk_norm=True,
            output_bias=True,
            vision=True,
            text_model="qwen3_5_text",
        ),
        Family(
            "qwen3_5_moe",
            "qwen3_5_moe_vl",
            "Qwen3.5 MoE as released (35B-A3B: the vision-language model)",
            BATCHED,
            megatron_scope=LANGUAGE_MODEL_ONLY,
            router_hooks=True,
            fused_experts=True,
            hybrid=True,
            qk_norm=True,
            output_bias=True,
            shared_expert=True,
            vision=True,
            text_model="qwen3_5_moe_text",
        ),
    )
}


LANGUAGE, VISION = "model.language_model.", "model.visual."
"""Where a released Qwen3.5 checkpoint keeps its language model's and its vision tower's tensors
(`lm_head` and `mtp.*` sit at the top, as in the text model)."""


def text_name(name: str) -> str | None:
    """A vision-language checkpoint's tensor name as its text model's (None: the vision tower's)."""
    if name.startswith(VISION):
        return None
    return "model." + name[len(LANGUAGE) :] if name.startswith(LANGUAGE) else name


def language_name(name: str) -> str:
    """A text model's tensor name in its vision-language checkpoint (`text_name`'s inverse; a name
    already the vision-language model's, its vision tower's included, stays)."""
    if name.startswith("model.") and not name.startswith((LANGUAGE, VISION)):
        return LANGUAGE + name[len("model.") :]
    return name


def text_config(config: Any) -> Any:
    """The config of the model a text-only trainer builds: a vision-language family's text model
    (a copy of its `text_config`, model_type `Family.text_model`, with the whole model's
    `tie_word_embeddings` and dtype, by which transformers builds and stores it, as
    `slime.tools.text_model extract` writes them), any other config as it is."""
    import copy

    f = family(getattr(config, "model_type", None))
    if f is None or not f.text_model:
        return config
    text = copy.deepcopy(config.text_config)
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    if getattr(config, "dtype", None) is not None:
        text.dtype = config.dtype
    return text


def family(model_type: str | None) -> Family | None:
    """The family of a config.json's model_type, None for one not listed."""
    return FAMILIES.get(model_type or "")


def is_vision(model_type: str | None) -> bool:
    """A vision-language family (images in prompts)."""
    f = family(model_type)
    return f is not None and f.vision


def auto_model_class(config: object) -> Any:
    """transformers' Auto class that builds `config`'s model with its output head: the causal LM,
    or the image-text-to-text model of a vision-language family."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return (
        AutoModelForImageTextToText
        if is_vision(getattr(config, "model_type", None))
        else AutoModelForCausalLM
    )


UNLISTED = Family("", "", "a family not listed", PER_SEQUENCE)
"""What is known of a model_type the registry does not list: none of the layer traits."""


def layer_traits(model_type: str | None) -> Family:
    """The family of `model_type`, to read its layer traits (`qk_norm`, ...): UNLISTED, with none,
    for a family not listed."""
    return family(model_type) or UNLISTED


def packable(model_type: str | None, backend: str = "fsdp") -> bool:
    """Whether micro-batches of `model_type` may be packed by `backend` (an unknown family: as
    the others; the Megatron backend packs every family it builds)."""
    f = family(model_type)
    return f is None or f.packs or backend == "megatron"


def refusal(model_type: str | None, feature: str) -> str | None:
    """Why `feature` ("router_hooks") is refused for `model_type` (None: it is built, or the
    family is unknown and the feature's own checks decide)."""
    f = family(model_type)
    if f is None or getattr(f, feature):
        return None
    what = {"router_hooks": "routing replay and the router's aux loss are"}[feature]
    return f"{what} not built for model_type {f.model_type!r} ({f.models}) yet (docs/models.md)"


def value_model_refusal(model_type: str | None) -> str | None:
    """Why the FSDP backend's PPO critic (transformers' *ForTokenClassification on the model) is
    not built for `model_type` (None: it is, or the family is not listed): transformers has no
    token classifier of GLM-4.5+, the Qwen3.5 text models, Qwen3-VL or Qwen3.5-MoE (it has one of
    Qwen3.5 as released). The Megatron backend's critic is its own."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES

    f = family(model_type)
    if f is None or model_type in MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES:
        return None
    return (
        f"model_type {model_type!r}: a value model (PPO's critic) of this model is not built with FSDP "
        "(transformers has no token classifier of it); use --advantage-estimator grpo (or another "
        "critic-free one)"
    )


def routes_in_fp32(model_type: str | None, param_dtype: str) -> bool:
    """Whether a model of `model_type` trained with parameters in `param_dtype` routes in float32."""
    f = family(model_type)
    return param_dtype == "float32" or (f is not None and f.router_fp32)


def megatron_refusal(model_type: str | None) -> str | None:
    """Why the Megatron backend refuses `model_type` (None: it builds it)."""
    f = family(model_type)
    if f is None:
        return "not among the families the Megatron backend builds"
    return f.megatron


def models_table() -> str:
    """docs/models.md's table, from the registry."""
    yes = {True: "yes", False: "no"}
    lines = [
        "| model_type | models | `make_tiny_model --arch` | engine runner | FSDP | Megatron and "
        "conversion | routing replay, aux loss |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in FAMILIES.values():
        lines.append(
            f"| `{f.model_type}` | {f.models} | {f'`{f.arch}`' if f.arch else '-'} | {f.engine} | "
            f"{'yes' if f.packs else 'yes (padded rows)'} | "
            f"{megatron_cell(f)} | {yes[f.router_hooks]} |"
        )
    return "\n".join(lines) + "\n"


def megatron_cell(f: Family) -> str:
    if f.megatron is not None:
        return "no: " + f.megatron
    return f"yes: {f.megatron_scope}" if f.megatron_scope else "yes"


def write_docs(path: str = "docs/models.md") -> None:
    """Replace the table in `path` (from its header row to the first blank line) with the registry's."""
    with open(path) as f:
        text = f.read()
    start = text.index("| model_type |")
    end = text.index("\n\n", start) + 1
    with open(path, "w") as f:
        f.write(text[:start] + models_table() + text[end:])


if __name__ == "__main__":  # python -m slime.utils.model_families --write
    import sys

    if sys.argv[1:] != ["--write"]:
        raise SystemExit(
            "usage: python -m slime.utils.model_families --write  (rewrites docs/models.md's table)"
        )
    write_docs()
