"""Model FLOPs of a train step, counted from a Hugging Face config, and the GPUs' peak throughput:
what slime's `perf/actor_train_tflops`, `perf/log_probs_tflops`, `perf/ref_log_probs_tflops` and
`perf/actor_train_tok_per_s` are computed from (and our `perf/actor_train_mfu`).

A forward pass over a sequence of s tokens costs 2·N·s + A(s) FLOPs:

- N, the matmul weights one token goes through: every linear projection of every layer (q/k/v/o
  or multi-head latent attention's low-rank projections; the gated MLP's three matrices; of a
  mixture of experts, the router and only the experts a token is routed to plus the shared
  ones) and the output head, once, tied to the input embedding or not. The input embedding is a
  lookup (no FLOPs); norms, biases, rotary embeddings and activations are elementwise and left
  out, as slime and the PaLM paper's 6N count leave them out.
- A(s), causal attention's two matmuls (scores QKᵀ and the weighted sum over V): 2·(dk + dv)
  FLOPs per query-key pair and head, with query-key width dk and value width dv, over the s²/2
  pairs of a causal layer (a token attends only to those before it; slime's count), so
  (dk + dv)·s² per layer and head: per token and training step 6·layers·heads·head_dim·s, half
  the PaLM paper's 12·L·H·Q·T, which counts attention without the causal mask. It depends on
  each sequence's own length, so packed sequences are counted one by one. A sliding-window layer
  (window w < s) has w·s - w²/2 pairs instead.

A training step is three forward passes' worth (the backward pass computes two matmuls for each
forward one): 6·N·s + 3·A(s) per sequence; a log-prob pass is one forward. This is model FLOPs:
recomputation (gradient checkpointing), padding and communication are not counted, so the
achieved TFLOPS and MFU measure useful work.

No torch or transformers import here: the count reads the config's numbers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

DENSE_FAMILIES = frozenset({"llama", "mistral", "qwen2", "qwen3", "glm4", "qwen3_vl_text"})
EXPERT_FAMILIES = frozenset({"qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v3", "glm4_moe", "glm4_moe_lite"})
COUNTED_FAMILIES = DENSE_FAMILIES | EXPERT_FAMILIES
"""The model_types `from_config` counts (a vision-language model: its text model's). Any other
family (Qwen3-Next's and Qwen3.5's gated delta-nets among them) falls back to `from_parameters`."""

PEAK_BF16_TFLOPS: dict[str, float] = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,  # SXM: "NVIDIA H100 80GB HBM3"
    "H800 PCIe": 756.0,
    "H800": 989.0,  # H100's compute, NVLink cut
    "H200 NVL": 835.0,
    "H200": 989.0,  # SXM; GH200 too (same Hopper GPU)
    "H20": 148.0,
    "GB200": 2500.0,
    "B200": 2250.0,  # HGX B200 (1,000 W)
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
}
"""Dense (no 2:4 sparsity) BF16 tensor-core peak TFLOPS per GPU from NVIDIA's datasheets (their
headline figures are the sparse ones, twice these), keyed by a substring of
torch.cuda.get_device_name(); the longest key that matches wins ("H100 PCIe" before "H100")."""


def peak_tflops(device_name: str | None) -> float | None:
    """The dense BF16 peak of the GPU named `device_name` (torch.cuda.get_device_name()); None
    for a CPU (None) or a GPU not in PEAK_BF16_TFLOPS: MFU is then not reported."""
    if not device_name:
        return None
    for key in sorted(PEAK_BF16_TFLOPS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return PEAK_BF16_TFLOPS[key]
    return None


@dataclass(frozen=True)
class ModelFlops:
    """A model's FLOPs per token and per sequence (see the module docstring)."""

    matmul_params: int
    """N: the matmul weights one token goes through (active experts only, output head included)."""
    attention: tuple[tuple[int, int | None], ...] = ()
    """(width, window) per group of attention layers: width = layers x heads x (dk + dv), window
    None for full causal attention. Empty where unknown (`from_parameters`)."""
    source: str = "config"
    """`config`: counted from the config's shapes; `parameters`: from a parameter count (fallback)."""

    def forward_flops(self, seq_lens: Iterable[int]) -> float:
        """FLOPs of one forward pass over sequences of these lengths."""
        total = 0.0
        for s in seq_lens:
            total += 2.0 * self.matmul_params * s
            for width, window in self.attention:
                total += 2.0 * width * _causal_pairs(s, window)
        return total

    def train_flops(self, seq_lens: Iterable[int]) -> float:
        """FLOPs of forward and backward over sequences of these lengths (3 x forward)."""
        return 3.0 * self.forward_flops(seq_lens)


def _causal_pairs(s: int, window: int | None) -> float:
    """Query-key pairs a causal attention layer multiplies, counted as slime does (s²/2)."""
    if window is None or s <= window:
        return s * s / 2.0
    return window * s - window * window / 2.0


def step_perf(
    flops: ModelFlops | None,
    seq_lens: Sequence[int],
    num_gpus: int,
    seconds: dict[str, float],
    peak: float | None = None,
) -> dict[str, float]:
    """One train call's throughput, as slime defines it (names without the `perf/` prefix).

    Args:
        flops: the model's count (None: only the token rate is reported).
        seq_lens: prompt + response tokens of every sample of the rollout, all data-parallel
            replicas together (each is trained once per rollout, whatever the number of steps).
        num_gpus: the train ranks (data x tensor x pipeline x context parallel): the FLOPs are
            shared among them.
        seconds: this rank's wall time of `actor_train` (the optimizer steps), `log_probs` (the
            actor's log-prob pass) and `ref_log_probs` (the reference's), where they ran.
        peak: the GPU's peak TFLOPS (None: no MFU).

    Returns:
        `actor_train_tok_per_s` (tokens trained per second over all replicas),
        `actor_train_tflops`, `log_probs_tflops`, `ref_log_probs_tflops` (achieved TFLOPS per
        GPU), `actor_train_mfu` (actor_train_tflops / peak).
    """
    out: dict[str, float] = {}
    tokens = float(sum(seq_lens))
    train_s = seconds.get("actor_train", 0.0)
    if train_s > 0:
        out["actor_train_tok_per_s"] = tokens / train_s
    if flops is None:
        return out
    forward_tflop = flops.forward_flops(seq_lens) / num_gpus / 1e12
    for name in ("log_probs", "ref_log_probs"):
        if seconds.get(name, 0.0) > 0:
            out[f"{name}_tflops"] = forward_tflop / seconds[name]
    if train_s > 0:
        out["actor_train_tflops"] = 3.0 * forward_tflop / train_s
        if peak:
            out["actor_train_mfu"] = out["actor_train_tflops"] / peak
    return out


# ---- counting from the config ------------------------------------------------------------------


class _Config:
    """A config.json dict or a transformers config object, read alike."""

    def __init__(self, config: Any):
        self.c = config

    def get(self, *names: str, default: Any = None) -> Any:
        """The first of `names` the config sets (not None)."""
        for name in names:
            value = self.c.get(name) if isinstance(self.c, dict) else getattr(self.c, name, None)
            if value is not None:
                return value
        return default


def text_config(config: Any) -> Any:
    """A vision-language config's text model's config (any other config as it is)."""
    if isinstance(config, dict):
        return config.get("text_config") or config
    getter = getattr(config, "get_text_config", None)
    return getter() if getter is not None else config


def from_config(config: Any) -> ModelFlops | None:
    """The FLOPs of a model of COUNTED_FAMILIES from its Hugging Face config (a dict or a
    transformers config; of a vision-language model, its text model: the vision tower is not
    counted); None for another family."""
    c = _Config(text_config(config))
    if c.get("model_type") not in COUNTED_FAMILIES:
        return None
    h, layers, vocab = c.get("hidden_size"), c.get("num_hidden_layers"), c.get("vocab_size")
    attention_params, width = _attention(c)
    mlp = _mlp_params(c)
    windows = _windows(c)
    groups: dict[int | None, int] = {}
    for window in windows:
        groups[window] = groups.get(window, 0) + width
    n = layers * attention_params + sum(mlp) + h * vocab
    return ModelFlops(int(n), tuple((w, window) for window, w in groups.items()), "config")


def _attention(c: _Config) -> tuple[int, int]:
    """One layer's attention: its projections' weights and heads x (dk + dv)."""
    h, heads = c.get("hidden_size"), c.get("num_attention_heads")
    if c.get("kv_lora_rank") is not None:  # multi-head latent attention (DeepSeek-V3, GLM-4.7-Flash)
        nope, rope, dv = c.get("qk_nope_head_dim"), c.get("qk_rope_head_dim"), c.get("v_head_dim")
        dk, q_rank, kv_rank = nope + rope, c.get("q_lora_rank"), c.get("kv_lora_rank")
        q = h * heads * dk if q_rank is None else h * q_rank + q_rank * heads * dk
        kv = h * (kv_rank + rope) + kv_rank * heads * (nope + dv)
        return q + kv + heads * dv * h, heads * (dk + dv)
    kv_heads = c.get("num_key_value_heads", default=heads)
    d = c.get("head_dim", default=h // heads)
    return h * heads * d + 2 * h * kv_heads * d + heads * d * h, 2 * heads * d


def _mlp_params(c: _Config) -> list[int]:
    """Each layer's MLP weights a token goes through: the gated MLP's three matrices; in a
    mixture-of-experts layer the router, the top-k experts and the shared experts."""
    h, layers = c.get("hidden_size"), c.get("num_hidden_layers")
    dense = 3 * h * c.get("intermediate_size", default=0)
    experts = c.get("num_experts", "num_local_experts", "n_routed_experts", default=0)
    top_k = c.get("num_experts_per_tok", default=0)
    if not experts or not top_k:
        return [dense] * layers
    width = c.get("moe_intermediate_size", "intermediate_size")  # Mixtral's experts: intermediate_size
    shared = c.get("shared_expert_intermediate_size", default=0)  # Qwen's, with a 1-wide gate
    gate = h if shared else 0
    shared = shared or c.get("n_shared_experts", default=0) * width  # DeepSeek's and GLM's
    sparse = h * experts + 3 * h * width * top_k + 3 * h * shared + gate
    return [sparse if _is_sparse(c, i) else dense for i in range(layers)]


def _is_sparse(c: _Config, i: int) -> bool:
    """Whether layer `i` is a mixture of experts, by transformers' rule for the family."""
    kinds = c.get("mlp_layer_types")  # GLM-4.7-Flash
    if kinds is not None:
        return bool(kinds[i] == "sparse")
    first_dense = c.get("first_k_dense_replace")  # DeepSeek-V3, GLM-4.5
    if first_dense is not None:
        return bool(i >= first_dense)
    step = c.get("decoder_sparse_step", default=1)  # Qwen2/3-MoE (Mixtral: every layer)
    return i not in (c.get("mlp_only_layers", default=()) or ()) and (i + 1) % step == 0


def _windows(c: _Config) -> list[int | None]:
    """Each layer's attention window (None: the whole causal prefix)."""
    layers = c.get("num_hidden_layers")
    window = c.get("sliding_window")
    kinds = c.get("layer_types")
    if kinds is not None:
        return [window if kind == "sliding_attention" else None for kind in kinds]
    if c.get("use_sliding_window") is False:  # Qwen's switch (the dict of a config.json)
        window = None
    return [window] * layers


# ---- the fallback: a parameter count -----------------------------------------------------------


def from_parameters(num_params: int, config: Any = None) -> ModelFlops:
    """A family `from_config` cannot count: 2 FLOPs per token and forward for each of
    `num_params` matmul weights (`active_parameters` of the model). Only the full-attention
    layers' attention term is added (where `config` lists them in `layer_types` with their heads);
    a gated delta-net's recurrence is not counted, nor any term of unknown layers."""
    width = 0
    if config is not None:
        c = _Config(text_config(config))
        heads, h = c.get("num_attention_heads"), c.get("hidden_size")
        kinds = c.get("layer_types") or ()
        if heads and h:
            d = c.get("head_dim", default=h // heads)
            width = sum(2 * heads * d for kind in kinds if kind == "full_attention")
    return ModelFlops(int(num_params), ((width, None),) if width else (), "parameters")


def active_parameters(model: Any, config: Any) -> int:
    """The matmul weights one token goes through, counted on a transformers model (a meta-device
    one will do): every parameter of two or more dimensions except the input embedding, the
    output head once even when tied to it, and a routed expert's weights (a module named
    `experts`) scaled by top-k / experts. No torch import: `model` is read by duck typing."""
    c = _Config(text_config(config))
    experts = c.get("num_experts", "num_local_experts", "n_routed_experts", default=0)
    top_k = c.get("num_experts_per_tok", default=0)
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    total = float(head.weight.numel()) if head is not None and head.weight is embedding else 0.0
    for name, param in model.named_parameters():
        if param is embedding or param.dim() < 2:
            continue
        routed = experts and top_k and "experts" in name.split(".")
        total += param.numel() * top_k / experts if routed else param.numel()
    return round(total)
