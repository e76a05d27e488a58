"""The gated delta-net (linear-attention) layers of Qwen3-Next and Qwen3.5 in a megatron-core
model. Imported only where megatron-core is installed.

megatron-core 0.16 has a gated delta-net of its own (megatron.core.ssm.gated_delta_net), but it
runs only with the flash-linear-attention kernels (Triton, CUDA), fuses the projections in its own
layout, and has no context parallelism. slime's Megatron models instead run transformers' own
module for the family (Qwen3NextGatedDeltaNet, Qwen3_5GatedDeltaNet, Qwen3_5MoeGatedDeltaNet)
inside the attention slot of megatron-core's TransformerLayer, with its own zero-centred input
norm, named as slime names them: `self_attention.input_layernorm.weight` and
`self_attention.linear_attn.*` (HF's names). Its kernels are transformers' choice: the
flash-linear-attention ones where that package is installed, its torch reference otherwise, so
the layer computes what the FSDP actor and the engine compute.

The module is replicated over the tensor-parallel ranks (each computes the whole layer, as slime
does), so its parameters' gradients are the same on every TP rank up to the kernels' rounding
(a GPU's convolution and delta-rule kernels need not be bit-reproducible): they are averaged over
TP after each backward, so the replicas never drift apart (the push checks that they agree). Packed
micro-batches (THD) run one sequence at a time (a delta-net's state carries through a row, so
sequences must not share one); padded rows run as one batch (right padding: a causal layer's real
tokens never read it). With sequence parallelism the tokens are gathered over TP first and
scattered back after; with context parallelism each sequence is all-gathered over the CP ranks,
the layer runs on whole sequences on every CP rank, and each keeps its own chunks (backward: the
inputs' gradients summed over the CP ranks, since every rank's outputs read every earlier token).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from megatron.core.transformer.module import MegatronModule

from slime.backends.megatron.layers import ZeroCenteredRMSNorm
from slime.backends.micro_batch import host_bounds


def hf_delta_net_class(model_type: str) -> Any:
    """transformers' gated delta-net module for a family."""
    if model_type == "qwen3_next":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        return Qwen3NextGatedDeltaNet
    if model_type in ("qwen3_5_text", "qwen3_5"):
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        return Qwen3_5GatedDeltaNet
    if model_type in ("qwen3_5_moe_text", "qwen3_5_moe"):
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeGatedDeltaNet

        return Qwen3_5MoeGatedDeltaNet
    raise ValueError(f"model_type {model_type!r} has no gated delta-net layers")


class LinearAttention(MegatronModule):
    """A gated delta-net layer in the attention slot: input norm, then transformers' module."""

    def __init__(self, config: Any, layer_number: int, hf_config: Any = None, **_: Any) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number  # megatron-core's: global, from 1
        self.input_layernorm = ZeroCenteredRMSNorm(config, config.hidden_size, config.layernorm_epsilon)
        self.linear_attn = hf_delta_net_class(hf_config.model_type)(hf_config, layer_number - 1)
        device = None
        if torch.cuda.is_available() and not config.use_cpu_initialization:
            device = torch.cuda.current_device()
        self.to(device=device, dtype=config.params_dtype)
        for p in self.parameters():  # replicated over TP: their gradients averaged there (grads.py)
            p.average_over_tp = True  # type: ignore[attr-defined]

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Any = None,
        *args: Any,
        packed_seq_params: Any = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        from megatron.core import parallel_state, tensor_parallel

        x = hidden_states  # [tokens, rows, hidden] (THD: rows 1)
        if self.config.sequence_parallel:
            x = tensor_parallel.gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=False, group=parallel_state.get_tensor_model_parallel_group()
            )
        cu = None if packed_seq_params is None else tuple(host_bounds(packed_seq_params.cu_seqlens_q))
        if self.config.context_parallel_size > 1:
            from slime.backends.megatron.context_parallel import own_tokens, whole_sequences

            assert cu is not None  # (context parallelism runs packed micro-batches only)
            group = parallel_state.get_context_parallel_group()
            out = own_tokens(self._run(whole_sequences(x, cu, group), cu), cu, group)
        else:
            out = self._run(x, cu)
        if self.config.sequence_parallel:
            out = tensor_parallel.scatter_to_sequence_parallel_region(
                out, group=parallel_state.get_tensor_model_parallel_group()
            )
        return out, None

    def _run(self, x: torch.Tensor, cu: tuple[int, ...] | None) -> torch.Tensor:
        x = self.input_layernorm(x)
        if cu is None:  # padded rows: [s, b, h] -> the module's [b, s, h]
            return self.linear_attn(x.transpose(0, 1).contiguous()).transpose(0, 1).contiguous()
        # each sequence apart (the row's tail past the last one, if any: padding)
        edges = sorted({0, *cu, x.shape[0]})
        outs = [
            self.linear_attn(x[a:b].transpose(0, 1)).transpose(0, 1) for a, b in itertools.pairwise(edges)
        ]
        return torch.cat(outs)
