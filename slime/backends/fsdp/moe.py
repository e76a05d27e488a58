"""Mixture-of-experts routing in the FSDP actor: the router's precision, routing replay (R2, R3)
and megatron-core's load-balancing loss, on Hugging Face's MoE modeling.

A Hugging Face MoE block asks its router (`mlp.gate`) for (logits, top-k weights, top-k experts)
and runs the experts it names. A forward hook on every router replaces that answer when slime
needs another one, and leaves it untouched otherwise (no flag: bit-identical to Hugging Face):

- `--moe-router-dtype fp32|fp64`: logits, softmax and top-k in that precision;
- replay: the experts come from a table, one row per token (the engine's choice for R3, the
  log-prob pass's for R2; -1 keeps the router's own choice, e.g. for the last token, which the
  engine never fed); the weights are the router's own probabilities of those experts,
  renormalised as the model does, so the router still gets a gradient;
- recording: the experts chosen, one row per token (R2);
- `--moe-aux-loss-coeff`: the router probabilities and chosen experts of every MoE layer, for
  megatron-core's `aux_loss` (switch-transformer load balancing) per layer, summed over layers,
  or its `seq_aux_loss` (each sample's own).

Sigmoid routers (DeepSeek-V3, GLM-4.5+, GLM-4.7-Flash: an expert bias and groups) replay and
record alike: a replayed expert is weighed by its sigmoid score as the model weighs its own
choice (slime.backends.routing.sigmoid_weights); --moe-router-dtype fp64 recomputes the choice,
bias and groups included, in float64 (fp32 is what these routers compute anyway); the
load-balancing losses read megatron-core's scores for them (routing.sigmoid_aux_routing).

The hooks fire again when gradient checkpointing recomputes a layer in backward, so a micro-batch's
state stays set until its backward is done (`Routing.micro_batch`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from slime.backends.routing import (
    DTYPES,
    RouterHooks,
    choose,
    group_limited_topk,
    load_balancing_loss,
    sequence_balancing_loss,
    sigmoid_aux_routing,
    sigmoid_weights,
)
from slime.utils.errors import UsageError
from slime.utils.hf_experts import find_routers


@dataclass
class _State:
    """What the hooks do during one micro-batch (forward and backward)."""

    replay: torch.Tensor | None = None  # [tokens, layers, k] long, -1: the router's own choice
    record: dict[int, torch.Tensor] | None = None  # layer -> [tokens, k]
    aux: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # (probs [tokens, E], experts [tokens, k])
    aux_done: set[int] = field(default_factory=set)  # layers already captured (recompute: not again)

    @property
    def active(self) -> bool:
        return self.replay is not None or self.record is not None or self.aux is not None


class Routing(RouterHooks):
    """The hooks on one model's routers (module docstring)."""

    def __init__(self, layers: list[torch.nn.Module], router_dtype: str | None):
        self.routers = find_routers(layers)  # slime.utils.hf_experts
        if not self.routers:
            raise UsageError("the model has no mixture-of-experts layers")
        first: Any = next(iter(self.routers.values()))
        self.num_layers = len(layers)
        self.top_k: int = int(first.top_k)
        self.num_experts: int = int(first.num_experts)
        self.moe_layers = list(self.routers)
        self.sigmoid = hasattr(first, "e_score_correction_bias")
        self.dtype = DTYPES[router_dtype] if router_dtype else None
        if self.sigmoid and self.dtype == torch.float32:
            self.dtype = None  # (these routers compute in float32 whatever the parameters' dtype)
        self.state: _State | None = None
        for li, router in self.routers.items():
            router.register_forward_hook(self._hook(li))

    def _hook(self, li: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            state = self.state
            if self.dtype is None and (state is None or not state.active):
                return None  # the model's own routing, untouched (every forward without a flag)
            route = self._route_sigmoid if self.sigmoid else self._route
            return route(li, module, args[0], output, state or _State())

        return hook

    def _route(self, li: int, module: Any, hidden: torch.Tensor, output: Any, state: _State) -> Any:
        logits, weights, _ = output
        hidden = hidden.reshape(-1, hidden.shape[-1])
        if self.dtype is not None:
            logits = F.linear(hidden.to(self.dtype), module.weight.to(self.dtype))
        probs = torch.softmax(logits, dim=-1, dtype=self.dtype or torch.float32)
        replay = None if state.replay is None else state.replay[:, li]
        # (Qwen3.5-MoE's router always renormalises: it has no norm_topk_prob)
        top, experts = choose(probs, self.top_k, replay, getattr(module, "norm_topk_prob", True))
        if state.record is not None:
            state.record[li] = experts.detach()
        self._keep_aux(li, state, probs, experts.detach())
        return output[0], top.to(weights.dtype), experts

    def _route_sigmoid(self, li: int, module: Any, hidden: torch.Tensor, output: Any, state: _State) -> Any:
        logits, weights, experts = output
        if self.dtype is not None:
            hidden = hidden.reshape(-1, hidden.shape[-1])
            logits = F.linear(hidden.to(self.dtype), module.weight.to(self.dtype))
            bias = module.e_score_correction_bias
            experts = group_limited_topk(
                torch.sigmoid(logits), bias, self.top_k, module.num_group, module.topk_group
            )
        if state.aux is not None and li not in state.aux_done:
            scores, routed = sigmoid_aux_routing(logits, self.top_k)
            self._keep_aux(li, state, scores, routed.bool())
        replay = None if state.replay is None else state.replay[:, li]
        if replay is not None:
            experts = torch.where(replay >= 0, replay, experts)  # (the replay table is on the device)
        if state.record is not None:
            state.record[li] = experts.detach()
        if replay is None and self.dtype is None:
            return None  # recording or the aux loss only: the model's own routing stays
        top = sigmoid_weights(logits, experts, module.norm_topk_prob, module.routed_scaling_factor)
        return output[0], top.to(weights.dtype), experts

    @staticmethod
    def _keep_aux(li: int, state: _State, scores: torch.Tensor, routed: torch.Tensor) -> None:
        """The aux loss's scores and routing of layer `li`, once per micro-batch (not again when
        a checkpointed layer is recomputed)."""
        if state.aux is not None and li not in state.aux_done:
            state.aux.append((scores, routed))
            state.aux_done.add(li)

    @contextlib.contextmanager
    def micro_batch(
        self, replay: torch.Tensor | None = None, record: bool = False, aux: bool = False
    ) -> Iterator[_State]:
        """Set the hooks' state for one micro-batch; keep it until the block ends (after backward)."""
        self.state = _State(replay=replay, record={} if record else None, aux=[] if aux else None)
        try:
            yield self.state
        finally:
            self.state = None

    def recorded(self, state: _State, num_tokens: int, device: torch.device) -> torch.Tensor:
        """The experts recorded in a forward: [tokens, layers, k] (-1 in dense layers)."""
        assert state.record is not None
        out = torch.full((num_tokens, self.num_layers, self.top_k), -1, dtype=torch.long, device=device)
        for li, experts in state.record.items():
            out[:, li] = experts
        return out

    def aux_loss(
        self, state: _State, real: torch.Tensor, samples: torch.Tensor | None = None, num_samples: int = 0
    ) -> torch.Tensor:
        """megatron-core's `aux_loss` summed over the MoE layers, over the tokens at `real` (the
        indexes of the tokens that are not padding, on the device;
        slime.backends.routing.load_balancing_loss); with `samples` (each of those tokens'
        sample, of `num_samples`) its `seq_aux_loss`, summed over the samples."""
        assert state.aux is not None
        total = torch.zeros((), dtype=torch.float32, device=real.device)
        for probs, chosen in state.aux:
            routed = (
                chosen.float()
                if chosen.dtype == torch.bool  # a sigmoid router's: [tokens, E] already
                else torch.zeros_like(probs, dtype=torch.float32).scatter_(1, chosen, 1.0)
            )
            kept, routed = probs.index_select(0, real), routed.index_select(0, real)
            if samples is None:
                total = total + load_balancing_loss(kept, routed, self.top_k)
            else:
                total = total + sequence_balancing_loss(kept, routed, samples, num_samples, self.top_k)
        return total
