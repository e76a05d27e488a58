"""LoRA on parameters rather than linear layers, in PEFT's layout: a mixture-of-experts layer's
fused experts and its router, as PEFT adapts them (its `ParamWrapper`, `target_parameters`).

transformers holds a layer's routed experts as two 3-D parameters, `mlp.experts.gate_up_proj`
[E, 2I, H] and `mlp.experts.down_proj` [E, H, I] (each expert's weight [out, in]), and the router
weight `mlp.gate.weight` [E, H] in a module of its own. PEFT (0.18 on) adapts such a parameter
with one pair of factors for all the experts: A [E * r, in] and B [out, E * r]. Expert e's
adapter is A[e r : (e + 1) r] and B's columns e, E + e, 2 E + e, ... (B viewed as [out, r, E]);
its weight gains scaling * B_e A_e, as a linear layer's does. A 2-D parameter (the router) takes
one plain pair, A [r, H], B [E, r].

PEFT names the adapters of a module's wrapped parameters by nesting: the module's own name
carries the last wrapped parameter (in the module's parameter order), `<module>.base_layer` the
one before, and so on. With both expert parameters adapted, `mlp.experts.lora_A` is down_proj's
and `mlp.experts.base_layer.lora_A` gate_up_proj's; with one, `mlp.experts` is that one's.

On transformers 5, PEFT maps the transformers 4 names of a fused family (`gate_proj`, `up_proj`,
`down_proj` and the router `gate`, as `all-linear` did) onto these parameters, giving the fused
gate_up_proj twice the rank and twice the alpha (its scaling stays alpha / r). No PEFT import
here: the trainer, the engine and the Megatron actor share these rules.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

BASE_LAYER = ".base_layer"
_WRAPPER = re.compile(r"\.base_layer(?=\.)")


def targets(key: str, target_parameters: Iterable[str]) -> bool:
    """PEFT's rule: parameter `key` (`<module>.<param>`) is targeted when it is one of the names
    or ends with "." + one of them."""
    return any(key == t or key.endswith("." + t) for t in target_parameters)


def unwrapped(name: str) -> str:
    """A parameter's or buffer's name with PEFT's wrappers (`.base_layer`, once per nesting) left
    out: the checkpoint's name."""
    return _WRAPPER.sub("", name)


def targets_any(target: str, keys: Iterable[str]) -> bool:
    """Whether `target` names one of `keys` (full parameter names) by PEFT's rule, a wrapped
    parameter's `.base_layer`s left out."""
    return any(targets(unwrapped(k), [target]) for k in keys)


def wrapped(module: str, params: Sequence[str], target_parameters: Iterable[str]) -> list[str]:
    """The parameters of `module` (its own, in order) that PEFT wraps, innermost first."""
    names = list(target_parameters)
    return [p for p in params if targets(f"{module}.{p}", names)]


def resolve(adapter_module: str, params_wrapped: Sequence[str]) -> tuple[str, str]:
    """(the module, the parameter) an adapter's PEFT module name adapts, given the module's
    wrapped parameters innermost first: `x.experts.base_layer` with [gate_up_proj, down_proj]
    is ('x.experts', 'gate_up_proj'). KeyError when the nesting is deeper than the wrappers."""
    module, depth = adapter_module, 0
    while module.endswith(BASE_LAYER):
        module, depth = module[: -len(BASE_LAYER)], depth + 1
    if depth >= len(params_wrapped):
        raise KeyError(f"{adapter_module}: {module} wraps only {list(params_wrapped)}")
    return module, params_wrapped[len(params_wrapped) - 1 - depth]


def expert_factors(a: torch.Tensor, b: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert factors of a fused adapter: A [E r, in], B [out, E r] -> A_e [E, r, in],
    B_e [E, out, r] (views where the layout allows)."""
    r = a.shape[0] // num_experts
    assert a.shape[0] == r * num_experts and b.shape[1] == r * num_experts, (a.shape, b.shape, num_experts)
    return a.view(num_experts, r, a.shape[1]), b.view(b.shape[0], r, num_experts).permute(2, 0, 1)


def fuse_factors(a_e: torch.Tensor, b_e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `expert_factors`: A_e [E, r, in], B_e [E, out, r] -> A [E r, in], B [out, E r]."""
    num_experts, out, r = b_e.shape
    return a_e.reshape(num_experts * r, a_e.shape[2]), b_e.permute(1, 2, 0).reshape(out, r * num_experts)


def delta(a: torch.Tensor, b: torch.Tensor, scaling: float, shape: Sequence[int]) -> torch.Tensor:
    """scaling * B A in float32 for a parameter of `shape`: [E, out, in] (per expert, as PEFT's
    merge of transformers' fused experts) or [out, in]."""
    a, b = a.float(), b.float()
    if len(shape) == 2:
        return scaling * (b @ a)
    a_e, b_e = expert_factors(a, b, shape[0])
    return scaling * torch.bmm(b_e, a_e)


EXPERT_PARAMS = ("gate_up_proj", "down_proj")


def is_fused_experts(module: Any) -> bool:
    """transformers' fused experts in the layout these rules read: [gate; up] rows, each expert's
    weight [out, in], no biases. gpt-oss and others store them transposed (`is_transposed`) or
    with biases: not served, and refused by the trainers."""
    params = dict(module.named_parameters(recurse=False))
    return (
        hasattr(module, "num_experts")
        and all(name in params and params[name].dim() == 3 for name in EXPERT_PARAMS)
        and not getattr(module, "is_transposed", False)
        and getattr(module, "is_concatenated", True)
        and getattr(module, "has_gate", True)
        and not getattr(module, "has_bias", False)
    )


def uniform_scaling(config: Mapping[str, Any]) -> float:
    """alpha / r of a PEFT adapter config (alpha / sqrt(r) with `use_rslora`, as PEFT scales),
    the same for every module: a rank or alpha pattern is accepted only where it keeps that
    scaling (PEFT's own for a fused gate_up_proj does, unless with rsLoRA). ValueError naming the
    pattern otherwise."""
    rank, alpha = config["r"], config["lora_alpha"]
    rslora = bool(config.get("use_rslora"))

    def scaling(r: int, a: float) -> float:
        return float(a) / (r**0.5 if rslora else r)

    ranks, alphas = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    for key in set(ranks) | set(alphas):
        r_k, a_k = ranks.get(key, rank), alphas.get(key, alpha)
        if not math.isclose(scaling(r_k, a_k), scaling(rank, alpha), rel_tol=1e-12):
            raise ValueError(
                f"rank_pattern/alpha_pattern {key!r} gives rank {r_k} and alpha {a_k}, a scaling other than "
                f"lora_alpha / {'sqrt(r)' if rslora else 'r'} = {alpha} / {rank}: only one scaling for "
                "every module is served"
            )
    return scaling(rank, alpha)
