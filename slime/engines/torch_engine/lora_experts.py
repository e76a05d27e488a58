"""LoRA adapters on a mixture-of-experts layer's routed experts and router, as the torch engine
serves them (slime.engines.torch_engine.lora serves the linear layers' adapters): PEFT's adapters
of parameters (`target_parameters`; slime.utils.peft_experts has PEFT's names and layout).

transformers holds a layer's routed experts in one module (`mlp.experts`, 3-D `gate_up_proj`
[E, 2I, H] and `down_proj` [E, H, I]) and its router in another (`mlp.gate`, `weight` [E, H],
whose forward turns the logits into each token's top-k experts and weights). Neither is a linear
layer a forward hook could add to, so both get a forward of their own while an adapter is loaded:

* experts: transformers' eager loop over the experts, where each routed token's adapter adds
  scaling * B_e (A_e x) to expert e's gate_up and down projections (a merge of W_e + B_e A_e per
  forward would cost E * out * in per layer; this costs a rank-r product per routed token);
* router: the router's own forward over each adapter's tokens with the weight W + scaling * B A
  ([E, H]: small), so its softmax or sigmoid, groups and top-k are the family's own.

A forward whose rows use no adapter on the module calls transformers' own forward unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from slime.engines.protocol import ProtocolError
from slime.utils import peft_experts


@dataclass(frozen=True)
class ParamLoRA:
    """One adapter's factors of one parameter, in the parameter's dtype, on its device."""

    module: str
    """PEFT's module name of the adapter from `layers.<i>.` on (`...mlp.experts.base_layer`)."""
    a: torch.Tensor
    """Experts: A_e [E, r, in]; router: A [r, H]."""
    b: torch.Tensor
    """Experts: B_e [E, out, r]; router: B [E, r]."""

    def peft_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) as PEFT stores them: [E r, in] and [out, E r] for experts (dumps)."""
        return peft_experts.fuse_factors(self.a, self.b) if self.a.dim() == 3 else (self.a, self.b)


class TokenGroup(NamedTuple):
    """The tokens of one adapter in the current forward, with its factors on one module."""

    scaling: float
    factors: Mapping[str, ParamLoRA]
    """Parameter name -> factors (the module's parameters this adapter adapts)."""
    tokens: torch.Tensor
    """Indices into the forward's tokens, flattened row-major as the MoE block sees them."""


Groups = Callable[[str, int], list[TokenGroup]]
"""(module name from `layers.<i>.`, number of tokens) -> the adapters of the current forward's
rows that adapt that module, each with its tokens; empty when none does."""


def is_router(module: nn.Module) -> bool:
    """A router of transformers' MoE blocks: `weight` [E, H], `top_k` and `num_experts`."""
    weight = getattr(module, "weight", None)
    return (
        hasattr(module, "top_k")
        and hasattr(module, "num_experts")
        and isinstance(weight, nn.Parameter)
        and weight.dim() == 2
    )


def adaptable(model: nn.Module) -> dict[str, tuple[str, nn.Module]]:
    """The decoder's experts and routers by their names from `layers.<i>.` on (PEFT's and
    SGLang's): (the model's name of the module, the module)."""
    out = {}
    for name, module in model.named_modules():
        m = re.search(r"(layers\.\d+\..+)$", name)
        if m is not None and (peft_experts.is_fused_experts(module) or is_router(module)):
            out[m.group(1)] = (name, module)
    return out


def read_param_lora(
    adapter: str,
    adapter_module: str,
    ab: Mapping[str, tuple[str, torch.Tensor]],
    modules: Mapping[str, tuple[str, nn.Module]],
    target_parameters: list[str],
) -> tuple[str, str, ParamLoRA]:
    """(module, parameter, factors) of the adapter tensors `ab` ({"A"|"B": (stored name, tensor)})
    of PEFT module `adapter_module`, resolved with the config's `target_parameters` against the
    module's own parameters; ProtocolError (400) naming the adapter and the tensor otherwise."""
    stored = ab["A"][0]
    module = adapter_module.replace(peft_experts.BASE_LAYER, "")
    if module not in modules:
        raise ProtocolError(
            f"LoRA adapter {adapter!r}: the model has no linear layer, routed experts or router {module!r} "
            f"(tensor {stored!r})",
            400,
        )
    full_name, target = modules[module]
    own = [n for n, _ in target.named_parameters(recurse=False)]
    params = peft_experts.wrapped(full_name, own, target_parameters)
    try:
        _, param = peft_experts.resolve(adapter_module, params)
    except KeyError:
        raise ProtocolError(
            f"LoRA adapter {adapter!r}: tensor {stored!r} adapts a parameter of {module} that its config's "
            f"target_parameters {target_parameters} do not wrap (they wrap {params} of {own})",
            400,
        ) from None
    weight = getattr(target, param)
    a, b = _checked(adapter, f"{module}.{param}", ab, tuple(weight.shape))
    a, b = (t.to(weight.device, weight.dtype, copy=True) for t in (a, b))
    if weight.dim() == 3:
        a_e, b_e = peft_experts.expert_factors(a, b, weight.shape[0])
        a, b = a_e.contiguous(), b_e.contiguous()
    return module, param, ParamLoRA(adapter_module, a, b)


def _checked(
    adapter: str, param: str, ab: Mapping[str, tuple[str, torch.Tensor]], shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [E r, in] and B [out, E r] for a parameter [E, out, in]; A [r, in] and B [out, r] for
    [out, in]. The rank r may be the module's own (PEFT gives a fused gate_up_proj twice r)."""
    (a_name, a), (b_name, b) = ab["A"], ab["B"]
    experts = shape[0] if len(shape) == 3 else 1
    out, inp = shape[-2:]
    sizes = (a.shape[0] if a.dim() == 2 else 0, b.shape[1] if b.dim() == 2 else 0)
    r = next((n // experts for n in sizes if n > 0 and n % experts == 0), 1)
    want = {a_name: (experts * r, inp), b_name: (out, experts * r)}
    for name, t in ((a_name, a), (b_name, b)):
        if tuple(t.shape) != want[name]:
            per = f"{experts} experts x rank {r}" if experts > 1 else f"rank {r}"
            raise ProtocolError(
                f"LoRA adapter {adapter!r}: tensor {name!r} has shape {tuple(t.shape)}; {param} {shape} "
                f"with {per} needs A {want[a_name]} and B {want[b_name]}",
                400,
            )
    return a, b


def serve_experts(experts: nn.Module, module: str, groups: Groups) -> None:
    """Route the experts module's forward through `experts_forward` while adapters adapt it."""
    original = experts.forward

    def forward(
        hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        active = groups(module, hidden_states.shape[0])
        if not active:
            return original(hidden_states, top_k_index, top_k_weights)
        return experts_forward(experts, original, hidden_states, top_k_index, top_k_weights, active)

    experts.forward = forward  # type: ignore[method-assign]


def experts_forward(
    experts: Any,
    base_forward: Callable[..., torch.Tensor],
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    active: list[TokenGroup],
) -> torch.Tensor:
    """transformers' eager experts loop (each family's `Experts.forward`) over the groups' tokens,
    each group's adapter terms added inside every expert, lora_B(lora_A(x)) * scaling on the input
    side (PEFT folds scaling * B_e A_e into the weight first: equal in float32, an ulp apart in
    bfloat16); the other tokens (rows without an adapter) through `base_forward`, the module's own."""
    num_experts = experts.num_experts
    owner, base = _owners(hidden_states.shape[0], active, hidden_states.device)
    final = torch.zeros_like(hidden_states)
    expert_mask = F.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
    if base.numel():
        final[base] = base_forward(hidden_states[base], top_k_index[base], top_k_weights[base])
        expert_mask[:, :, base] = 0
    expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in expert_hit[:, 0].tolist():
        if e == num_experts:
            continue
        top_k_pos, token_idx = torch.where(expert_mask[e])
        x = hidden_states[token_idx]
        members = [(g, (owner[token_idx] == i).nonzero()[:, 0]) for i, g in enumerate(active)]
        gate_up = _add_lora(F.linear(x, experts.gate_up_proj[e]), x, members, "gate_up_proj", e)
        gate, up = gate_up.chunk(2, dim=-1)
        h = experts.act_fn(gate) * up
        y = _add_lora(F.linear(h, experts.down_proj[e]), h, members, "down_proj", e)
        y = y * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, y.to(final.dtype))
    return final


def _owners(
    num_tokens: int, active: list[TokenGroup], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's group index (-1: none), and the tokens of no group."""
    owner = torch.full((num_tokens,), -1, dtype=torch.long, device=device)
    for g, group in enumerate(active):
        owner[group.tokens] = g
    return owner, (owner < 0).nonzero()[:, 0]


def _add_lora(
    y: torch.Tensor, x: torch.Tensor, members: list[tuple[TokenGroup, torch.Tensor]], param: str, e: int
) -> torch.Tensor:
    for group, rows in members:
        factors = group.factors.get(param)
        if factors is not None and rows.numel():
            y.index_add_(0, rows, F.linear(F.linear(x[rows], factors.a[e]), factors.b[e]) * group.scaling)
    return y


class _Reweighted:
    """The router seen with another `weight` (every other attribute its own), for its forward to
    run on: torch.func.functional_call would call the module, and its forward hooks (the routing
    recorder of slime.engines.torch_engine.model_runner) would see each group's part."""

    def __init__(self, router: nn.Module, weight: torch.Tensor):
        self._router, self.weight = router, weight

    def __getattr__(self, name: str) -> Any:
        return getattr(self._router, name)


def serve_router(router: nn.Module, module: str, groups: Groups) -> None:
    """Route the router's forward through the adapters' weights for their tokens: each group's
    tokens through the router's own forward with W + scaling * B A, the other tokens with W, the
    outputs (logits, top-k weights, top-k indices) put back in token order."""
    original = router.forward
    unbound = type(router).forward

    def forward(hidden_states: torch.Tensor) -> Any:
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        active = groups(module, x.shape[0])
        if not active:
            return original(hidden_states)
        weight = router.get_parameter("weight")

        def reweighted(group: TokenGroup) -> _Reweighted:
            lora = group.factors["weight"]
            delta = peft_experts.delta(lora.a, lora.b, group.scaling, weight.shape)
            return _Reweighted(router, weight + delta.to(weight.dtype))  # as PEFT adds it

        if len(active) == 1 and active[0].tokens.numel() == x.shape[0]:  # every token, one adapter
            return unbound(reweighted(active[0]), x)
        parts = [(g.tokens, unbound(reweighted(g), x[g.tokens])) for g in active]
        base = _owners(x.shape[0], active, x.device)[1]
        if base.numel():
            parts.append((base, original(x[base])))
        outputs = range(len(parts[0][1]))
        return tuple(_stitch(x.shape[0], [(tokens, out[i]) for tokens, out in parts]) for i in outputs)

    router.forward = forward  # type: ignore[method-assign]


def _stitch(num_tokens: int, parts: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    first = parts[0][1]
    out = first.new_empty((num_tokens, *first.shape[1:]))
    for tokens, part in parts:
        out[tokens] = part
    return out
