"""How the batched runner (slime.engines.torch_engine.model_runner) turns one layer's attention
module into what its KV cache holds and its attention kernels read, for each attention kind,
with the model's own modules and rotary function:

* `GroupedQuery` (Llama, Qwen, Mistral, GLM-4, GLM-4.5): queries, keys and values per head; the
  cache holds every KV head's keys and values. With an output gate (the full-attention layers of
  Qwen3-Next and Qwen3.5: q_proj gives each head's query and gate) the output is gated by
  sigmoid(gate) before o_proj.
* `LatentAttention` (multi-latent attention: DeepSeek-V3, Kimi-K2, GLM-4.7-Flash): the cache holds
  each token's compressed latent and its rotated key part, kv_lora_rank + qk_rope_head_dim numbers
  a layer, as one key of one head; the values are the latent itself (the first kv_lora_rank
  numbers of each key, read in place). Attention runs in the absorbed form: each head's query
  for the non-rotary part is taken through kv_b_proj's key half into the latent's space, so
  q . k = q_latent . latent + q_rot . k_rot, and the attention's output over the latents goes
  through kv_b_proj's value half. This is the expanded attention of transformers' forward with
  its matrix products regrouped (equal up to float rounding).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

Rotate = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Projected = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]
"""Queries, the keys and values the cache takes, and what the output needs besides (a gate)."""


def rotary_function(attn: Any) -> Rotate:
    """The attention's own rotary function, `apply_rotary_pos_emb(q, k, cos, sin)` of its modeling
    module, so every family rotates as its Hugging Face forward does: Llama and Qwen the whole
    head, GLM-4.5 part of it, GLM-4 part of it interleaved; multi-latent attention the interleaved
    form where the config says `rope_interleave`."""
    module = sys.modules[type(attn).__module__]
    if getattr(getattr(attn, "config", None), "rope_interleave", False):
        return module.apply_rotary_pos_emb_interleave
    return module.apply_rotary_pos_emb


def text_model(model: Any) -> Any:
    """The decoder stack of a causal LM: `model.model`, or a vision-language model's language model
    (`model.model.language_model`)."""
    inner = model.model
    return getattr(inner, "language_model", inner)


def is_latent(attn: Any) -> bool:
    return hasattr(attn, "kv_a_proj_with_mqa") and hasattr(attn, "kv_b_proj")


class GroupedQuery:
    """Queries [B, H, T, D] and keys / values [B, KV, T, D] of Llama-style attention."""

    def __init__(self, attn: Any, num_heads: int, head_dim: int):
        self.rotate = rotary_function(attn)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.cache_heads = getattr(attn.config, "num_key_value_heads", None) or num_heads
        self.key_dim = head_dim
        self.value_dim: int | None = None  # values of their own, as wide as the keys
        self.unapplied: tuple[str, ...] = ()

    def qkv(self, attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Projected:
        B, T, _ = x.shape
        q = attn.q_proj(x)
        gate = None
        if q.shape[-1] == 2 * self.num_heads * self.head_dim:  # each head's query, then its gate
            q, gate = q.view(B, T, -1, 2 * self.head_dim).chunk(2, dim=-1)
            gate = gate.reshape(B, T, -1)
        q = q.reshape(B, T, -1, self.head_dim)
        k = attn.k_proj(x).view(B, T, -1, self.head_dim)
        v = attn.v_proj(x).view(B, T, -1, self.head_dim)
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = self.rotate(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        return q, k, v.transpose(1, 2), gate

    def output(self, attn: Any, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """out [B, H, T, D] -> the layer's attention output [B, T, hidden]."""
        B, _, T, _ = out.shape
        out = out.transpose(1, 2).reshape(B, T, -1)
        return attn.o_proj(out if gate is None else out * torch.sigmoid(gate))


class LatentAttention:
    """Multi-latent attention in the absorbed form (see the module docstring)."""

    def __init__(self, attn: Any, num_heads: int):
        self.rotate = rotary_function(attn)
        self.num_heads = num_heads
        self.rank, self.rope_dim = attn.kv_lora_rank, attn.qk_rope_head_dim
        self.nope_dim, self.v_dim = attn.qk_nope_head_dim, attn.v_head_dim
        self.cache_heads = 1
        self.key_dim = self.rank + self.rope_dim
        self.value_dim: int | None = self.rank  # the first `rank` numbers of each key
        self.unapplied: tuple[str, ...] = ("kv_b_proj",)  # its weight is read, the module not called

    def _kv_b(self, attn: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight per head, split: [H, nope, rank] (keys) and [H, v, rank] (values).
        Read at every call: a weight push replaces it in place."""
        w = attn.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def qkv(self, attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> Projected:
        """Queries [B, H, T, rank + rope] and the keys [B, 1, T, rank + rope] the cache holds; the
        values are the keys' first `rank` numbers."""
        B, T, _ = x.shape
        if getattr(attn, "q_lora_rank", None) is None:
            q = attn.q_proj(x)
        else:
            q = attn.q_b_proj(attn.q_a_layernorm(attn.q_a_proj(x)))
        q = q.view(B, T, self.num_heads, -1).transpose(1, 2)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = attn.kv_a_proj_with_mqa(x).split([self.rank, self.rope_dim], dim=-1)
        latent = attn.kv_a_layernorm(latent)
        q_rot, k_rot = self.rotate(q_rot, k_rot.view(B, 1, T, self.rope_dim), cos, sin)
        w_keys, _ = self._kv_b(attn)
        q_latent = torch.einsum("bhtn,hnr->bhtr", q_nope, w_keys)
        keys = torch.cat((latent.view(B, 1, T, self.rank), k_rot), dim=-1)
        return torch.cat((q_latent, q_rot), dim=-1), keys, keys[..., : self.rank], None

    def output(self, attn: Any, out: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """out [B, H, T, rank] (attention over the latents) -> [B, T, hidden]; no gate."""
        B, _, T, _ = out.shape
        _, w_values = self._kv_b(attn)
        values = torch.einsum("bhtr,hvr->bthv", out, w_values)
        return attn.o_proj(values.reshape(B, T, -1))


def attention_kind(attn: Any, num_heads: int, head_dim: int) -> GroupedQuery | LatentAttention:
    return LatentAttention(attn, num_heads) if is_latent(attn) else GroupedQuery(attn, num_heads, head_dim)
