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

Sigmoid routers (DeepSeek-V3, GLM-4.5+: a bias and expert groups; `score_function` sigmoid) get
the load-balancing losses only: their routing stays the model's, and the losses read
megatron-core's scores for them (slime.backends.routing.sigmoid_aux_routing).

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
    load_balancing_loss,
    sequence_balancing_loss,
    sigmoid_aux_routing,
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

    def __init__(
        self,
        layers: list[torch.nn.Module],
        router_dtype: str | None,
        norm_topk_prob: bool,
        score_function: str = "softmax",
    ):
        self.routers = find_routers(layers)  # slime.utils.hf_experts
        if not self.routers:
            raise UsageError("the model has no mixture-of-experts layers")
        first: Any = next(iter(self.routers.values()))
        self.num_layers = len(layers)
        self.top_k: int = int(first.top_k)
        self.num_experts: int = int(first.num_experts)
        self.moe_layers = list(self.routers)
        self.norm_topk_prob = norm_topk_prob
        self.dtype = DTYPES[router_dtype] if router_dtype else None
        self.score_function = score_function
        self.state: _State | None = None
        for li, router in self.routers.items():
            router.register_forward_hook(self._hook(li))

    def _hook(self, li: int) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            state = self.state
            if self.dtype is None and (state is None or not state.active):
                return None  # the model's own routing, untouched (every forward without a flag)
            return self._route(li, module, args[0], output, state or _State())

        return hook

    def _route(self, li: int, module: Any, hidden: torch.Tensor, output: Any, state: _State) -> Any:
        logits, weights, _ = output
        if self.score_function == "sigmoid":  # the load-balancing losses only: the model's routing stays
            if state.aux is not None and li not in state.aux_done:
                scores, routed = sigmoid_aux_routing(logits, self.top_k)
                state.aux.append((scores, routed.bool()))
                state.aux_done.add(li)
            return None
        hidden = hidden.reshape(-1, hidden.shape[-1])
        if self.dtype is not None:
            logits = F.linear(hidden.to(self.dtype), module.weight.to(self.dtype))
        probs = torch.softmax(logits, dim=-1, dtype=self.dtype or torch.float32)
        replay = None if state.replay is None else state.replay[:, li]
        top, experts = choose(probs, self.top_k, replay, self.norm_topk_prob)
        if state.record is not None:
            state.record[li] = experts.detach()
        if state.aux is not None and li not in state.aux_done:
            state.aux.append((probs, experts.detach()))
            state.aux_done.add(li)
        return output[0], top.to(weights.dtype), experts

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
        """megatron-core's `aux_loss` summed over the MoE layers, over the tokens where `real` is
        true (slime.backends.routing.load_balancing_loss); with `samples` (each token's sample,
        of `num_samples`) its `seq_aux_loss`, summed over the samples."""
        assert state.aux is not None
        total = torch.zeros((), dtype=torch.float32, device=real.device)
        for probs, chosen in state.aux:
            routed = (
                chosen.float()
                if chosen.dtype == torch.bool  # a sigmoid router's: [tokens, E] already
                else torch.zeros_like(probs, dtype=torch.float32).scatter_(1, chosen, 1.0)
            )
            if samples is None:
                total = total + load_balancing_loss(probs[real], routed[real], self.top_k)
            else:
                seq = samples.to(probs.device)[real]
                total = total + sequence_balancing_loss(
                    probs[real], routed[real], seq, num_samples, self.top_k
                )
        return total
