"""Decoder layers and norms of families megatron-core has no layer for, built on its
TransformerLayer. Imported only where megatron-core is installed.

GLM-4 normalises the attention's output and the MLP's output again before each residual add
(HF's `post_self_attn_layernorm` and `post_mlp_layernorm`; slime names them the same on the
Megatron side). SandwichNormLayer is megatron-core's TransformerLayer with those two norms: forward
hooks on its attention and MLP modules normalise their outputs, so megatron-core's own forward
(bias-dropout-add, recompute) runs unchanged around them. Built with the local layer spec only
(Transformer Engine's folds its norms into the linears).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_layer import TransformerLayer
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm


class SandwichNormLayer(TransformerLayer):
    def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, submodules, *args, **kwargs)
        if config.add_bias_linear:
            # The output bias is added after the hook (bias-dropout-add), so it would go un-normalised.
            raise NotImplementedError("sandwich norms with linear biases are not built")
        for name, module in (
            ("post_self_attn_layernorm", self.self_attention),
            ("post_mlp_layernorm", self.mlp),
        ):
            norm = build_module(
                submodules.input_layernorm,
                config=config,
                hidden_size=config.hidden_size,
                eps=config.layernorm_epsilon,
            )
            self.add_module(name, norm)
            module.register_forward_hook(_normalise_output(norm))


def _normalise_output(norm: torch.nn.Module) -> Any:
    def hook(
        _module: torch.nn.Module, _args: Any, output: tuple[torch.Tensor, Any]
    ) -> tuple[torch.Tensor, Any]:
        out, bias = output
        return norm(out), bias

    return hook


class ZeroCenteredRMSNorm(Qwen3NextRMSNorm):
    """The zero-centred RMSNorm of Qwen3-Next and Qwen3.5 (Megatron-LM's --apply-layernorm-1p:
    the weight is stored centred on 0 and scales by 1 + weight), as transformers computes it (in
    float32, cast back), for megatron-core's local layer spec: its torch norms refuse zero-centred
    weights. Built with megatron-core's norm arguments. (Not marked sequence-parallel: the local
    spec refuses sequence parallelism, and the delta-net's own norm sees whole sequences.)"""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-6, **_: Any) -> None:
        super().__init__(hidden_size, eps=eps)
