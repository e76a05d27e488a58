"""LoRA on a mixture-of-experts layer's experts and router on the Megatron actor: PEFT's adapters on
transformers' fused parameters (slime.utils.peft_experts), applied per expert on megatron-core's.

PEFT adapts `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I] with one
pair of factors each for all the experts, and the router weight `mlp.gate.weight` [E, H] with a
plain pair. Here those stay whole parameters on every rank of their pipeline stage, as the
linear layers' adapters do (slime.backends.megatron.lora), and the hooks take views of them:

- expert e's `linear_fc1` (SequentialMLP's local expert, its rows [gate; up] as gate_up_proj[e]'s)
  adds scaling * B_e A_e x of the gate_up_proj adapter, its `linear_fc2` that of down_proj's;
  this rank's experts are its expert-parallel rank's (global e = EP rank * local + j);
- the router's logits are megatron-core's `gating` with W + scaling * B A (folded in W's dtype,
  as PEFT folds it), before its top-k; the routing replay hooks, which call `gating` again, see
  the adapted logits too.

The experts' factors are not split over EP: a rank's gradient holds its experts' slices (zero
elsewhere), and the sum over the data-parallel group, which holds every EP rank, adds each
expert's replicas, every token counted once, as for the attention's adapters. All this at TP 1
(a MoE model's LoRA runs there: MoE with TP needs sequence parallelism, which needs Transformer
Engine); TP above 1, expert tensor parallelism and grouped experts are refused.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slime.backends.megatron.layer_map import layer_of
from slime.utils import hf_experts, peft_experts
from slime.utils.errors import UsageError

GATE_UP, DOWN, ROUTER = "gate_up_proj", "down_proj", "gate.weight"


@dataclass(frozen=True)
class ParamTarget:
    """One megatron-core module of this rank and the PEFT module whose adapter it takes."""

    module: str
    """The layer's name in this stage's model (its local numbering)."""
    adapter: str
    """The PEFT module (`model.layers.3.mlp.experts.base_layer`)."""
    expert: int
    """The global expert (-1: the router)."""
    num_experts: int


def plan(
    wrapped: dict[str, str], layers: range, num_experts: int, mesh: Any, grouped: bool
) -> list[ParamTarget]:
    """The targets of this rank for the PEFT modules of `wrapped` (module -> the checkpoint name
    of the parameter it adapts) in this stage's `layers`."""
    experts = [m for m, p in wrapped.items() if not p.endswith("." + ROUTER)]
    # The factors' gradients are whole on every rank (average_over_tp): at TP 1 only, which MoE
    # with LoRA is anyway (MoE with TP needs sequence parallelism, which needs Transformer Engine).
    why = (
        f"--tensor-model-parallel-size {mesh.tp}"
        if wrapped and mesh.tp > 1
        else "grouped experts"
        if experts and grouped
        else f"--expert-tensor-parallel-size {mesh.etp}"
        if experts and mesh.etp > 1
        else None
    )
    if why:
        raise UsageError(
            f"LoRA on {(experts or list(wrapped))[0]} (a mixture-of-experts layer's experts or router) with "
            f"{why} is not built on the Megatron backend: use TP 1, --transformer-impl local and expert "
            "tensor parallelism 1, or name the linear layers in --target-modules instead of all-linear, the "
            "expert names and --target-parameters"
        )
    local = num_experts // mesh.ep
    out = []
    for adapter, param in sorted(wrapped.items()):
        i = layer_of(param)
        if i is None or i not in layers:
            continue
        prefix = f"decoder.layers.{i - layers.start}.mlp."
        if param.endswith("." + ROUTER):
            out.append(ParamTarget(prefix + "router", adapter, -1, num_experts))
            continue
        fc = {GATE_UP: "linear_fc1", DOWN: "linear_fc2"}.get(param.rsplit(".", 1)[-1])
        if fc is None or not param.endswith(".mlp.experts." + param.rsplit(".", 1)[-1]):
            raise UsageError(
                f"LoRA on {param} is not built on the Megatron backend (use --train-backend fsdp)"
            )
        for j in range(local):
            e = mesh.ep_rank * local + j
            out.append(ParamTarget(f"{prefix}experts.local_experts.{j}.{fc}", adapter, e, num_experts))
    return out


def hook(lora: Any, target: ParamTarget, module: Any) -> None:
    """Put `target`'s adapter on `module` (`lora`: the MegatronLoRA holding the factors)."""
    if target.expert < 0:
        gating = module.gating

        def adapted_gating(x: torch.Tensor) -> torch.Tensor:
            if not lora.enabled:
                return gating(x)
            from megatron.core.transformer.moe.moe_utils import router_gating_linear

            # megatron-core's gating with W + scaling * B A, folded in W's dtype as PEFT folds it
            # (a bfloat16 router's near-tied top-k chooses as the FSDP actor's does)
            a, b = lora.pair(target.adapter)
            weight = module.weight + peft_experts.delta(a, b, lora.scaling, module.weight.shape).to(
                module.weight.dtype
            )
            dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(
                module.config.moe_router_dtype, x.dtype
            )
            return router_gating_linear(x, weight, module.bias, dtype)

        module.gating = adapted_gating
        return

    def add(m: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if not lora.enabled:
            return None
        out = output[0] if isinstance(output, tuple) else output
        a, b = lora.pair(target.adapter)
        a_e, b_e = peft_experts.expert_factors(a, b, target.num_experts)
        delta = args[0] @ a_e[target.expert].t() @ b_e[target.expert].t()
        out = out + (lora.scaling * delta).to(out.dtype)
        return (out, *output[1:]) if isinstance(output, tuple) else out

    module.register_forward_hook(add)


def merged(
    named: Iterator[tuple[str, torch.Tensor]],
    adapters: dict[str, torch.Tensor],
    wrapped: dict[str, str],
    model_type: str,
    num_experts: int,
    scaling: float,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint tensors with the experts' adapters merged, per expert as PEFT merges the fused
    parameter, cut as the checkpoint stores it (the router's merges as a linear layer's does:
    slime.backends.megatron.lora.merged)."""
    shapes = {}
    for module, param in wrapped.items():
        a = adapters[f"{module}.lora_A.default.weight"]
        b = adapters[f"{module}.lora_B.default.weight"]
        if not param.endswith("." + ROUTER):
            shapes[param] = (num_experts, b.shape[0], a.shape[1])
    by_param = {param: module for module, param in wrapped.items()}
    slices = hf_experts.checkpoint_slices(model_type, shapes)
    for name, t in named:
        where = slices.get(name)
        if where is None:
            yield name, t
            continue
        module = by_param[where.fused]
        a = adapters[f"{module}.lora_A.default.weight"].to(t.device).float()
        b = adapters[f"{module}.lora_B.default.weight"].to(t.device).float()
        a_e, b_e = peft_experts.expert_factors(a, b, num_experts)
        delta = scaling * (b_e[where.expert][where.rows] @ a_e[where.expert])
        yield name, (t.float() + delta).to(t.dtype)
