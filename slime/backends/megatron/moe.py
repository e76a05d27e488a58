"""Mixture-of-experts routing in the Megatron actor: routing replay (R2, R3) and the load-balancing
loss, on megatron-core's TopKRouter.

megatron-core's MoE layer asks its router for (probs [tokens, E], routing_map [tokens, E]) and
dispatches the tokens where the map says. A forward hook on every router replaces that answer when
slime needs another one and leaves it untouched otherwise (no flag: megatron-core's own routing):

- replay: the experts come from a table (slime.backends.routing), the weights are the router's own
  probabilities of them, renormalised as the model does, so the router still gets a gradient;
- recording (R2): the experts each token went to;
- `--moe-aux-loss-coeff`: megatron-core's `aux_loss` of the layer over the micro-batch's real
  tokens, times the coefficient and the micro-batch's share of the step's samples (the FSDP
  actor's definition, so both backends train alike), attached to the router's output with
  megatron-core's MoEAuxLossAutoScaler: its gradient joins the backward pass (the schedule scales
  it by 1 under `calculate_per_token_loss`). megatron-core's own aux loss stays off: it weights
  micro-batches by tokens, not by samples. With `--moe-router-load-balancing-type seq_aux_loss`
  it is megatron-core's per-sequence loss instead: each sample's own, divided by the step's
  samples (megatron-core's is a micro-batch's [sequence, batch] rows, which packing would mix).

Sigmoid routers (DeepSeek-V3, GLM-4.5+, GLM-4.7-Flash: an expert bias and groups) replay and
record alike: a replayed expert is weighed by its sigmoid score as megatron-core weighs its own
choice (routing.sigmoid_weights); a token the table leaves to the router (-1) keeps megatron-core's
choice, bias and groups included. The load-balancing losses read megatron-core's scores for them
(the sigmoid scores normalised over the experts, and their own top-k; routing.sigmoid_aux_routing).

Tokens reach the router as [sequence, rows] flattened (sequence-major), and with sequence
parallelism only this TP rank's slice of the sequence; the per-token state is laid out that way.

With full recompute (`--recompute-granularity full`) a checkpointed layer runs twice: once without
autograd in the forward pass, again in the backward pass. Under the pipeline schedule the second
run may come after later micro-batches' forwards, so each checkpointed layer keeps its micro-batch
states in a queue: micro-batches go backward in the order they went forward (1F1B).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from slime.backends.micro_batch import MicroBatch
from slime.backends.routing import (
    RouterHooks,
    choose,
    load_balancing_loss,
    real_token_index,
    sequence_balancing_loss,
    sigmoid_aux_routing,
    sigmoid_weights,
)
from slime.utils import transfer


def router_order(x: torch.Tensor, rows: int, sp_rank: int = 0, sp_size: int = 1) -> torch.Tensor:
    """A per-token tensor over [rows, length] flattened (row-major) in the router's order:
    sequence-major, rank `sp_rank`'s slice of the sequence under sequence parallelism."""
    length = x.shape[0] // rows
    x = x.reshape(rows, length, *x.shape[1:]).transpose(0, 1).reshape(length * rows, *x.shape[1:])
    part = x.shape[0] // sp_size
    return x[sp_rank * part : (sp_rank + 1) * part]


def from_router_order(x: torch.Tensor, rows: int, sp_group: Any = None, sp_size: int = 1) -> torch.Tensor:
    """`router_order`'s inverse: the slices all-gathered over the sequence-parallel group, back
    to [rows, length] flattened."""
    if sp_size > 1:
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(sp_size)]
        dist.all_gather(parts, x.contiguous(), group=sp_group)
        x = torch.cat(parts)
    length = x.shape[0] // rows
    return x.reshape(length, rows, *x.shape[1:]).transpose(0, 1).reshape(length * rows, *x.shape[1:])


@dataclass
class MicroBatchRouting:
    """What the hooks do during one micro-batch, per token in the router's order. The per-token
    tables are built on the host and go to the device without a wait: the replay table a layer's
    slice at a time, the real tokens' indexes and samples when the state is made."""

    replay: torch.Tensor | None = None  # [tokens, layers, k] long, -1: the router's own choice
    record: dict[int, torch.Tensor] | None = None  # layer -> [tokens, k]
    real: torch.Tensor | None = None  # [real tokens] long (device): where tokens are not padding
    aux_coeff: float = 0.0  # --moe-aux-loss-coeff (0: no aux loss)
    samples: torch.Tensor | None = None  # seq_aux_loss: [real tokens] each one's sample (device)
    num_samples: int = 0  # the micro-batch's samples, and the step's (for the aux loss)
    step_samples: int = 0
    aux_sum: Any = 0.0  # the aux losses attached, times their share (the step's metric; a tensor
    # once one is attached: summed on the device, read once after the step, no sync per layer)

    @property
    def active(self) -> bool:
        return self.replay is not None or self.record is not None or self.aux_coeff > 0

    @property
    def aux_share(self) -> float:
        """The micro-batch's share of the step's samples (the aux loss's weight)."""
        return self.num_samples / self.step_samples


class MegatronRouting(RouterHooks):
    """The hooks on one pipeline stage's routers (module docstring)."""

    def __init__(
        self,
        model: Any,
        num_layers: int,
        top_k: int,
        num_experts: int,
        renormalize: bool,
        recompute: dict[str, Any],
        sp_group: Any = None,
        sp_rank: int = 0,
        sp_size: int = 1,
        score_function: str = "softmax",
    ):
        from megatron.core.transformer.moe.router import TopKRouter

        self.num_layers, self.top_k, self.num_experts = num_layers, top_k, num_experts
        self.renormalize, self.score_function = renormalize, score_function
        self.sp_group, self.sp_rank, self.sp_size = sp_group, sp_rank, sp_size
        self.current: MicroBatchRouting | None = None
        self.queues: dict[int, deque[MicroBatchRouting | None]] = {}
        self.routers: dict[int, Any] = {}
        for local, layer in enumerate(model.decoder.layers):
            router = getattr(layer.mlp, "router", None)
            if not isinstance(router, TopKRouter):
                continue
            if router.score_function != score_function:
                raise ValueError(
                    f"the router hooks expect {score_function} routers, not {router.score_function}"
                )
            li = layer.layer_number - 1  # the whole model's layer (megatron-core counts from 1)
            self.routers[li] = router
            checkpointed = recompute.get("recompute_granularity") == "full" and (
                recompute.get("recompute_method") == "uniform"
                or local < recompute.get("recompute_num_layers", 0)
            )
            if checkpointed:
                self.queues[li] = deque()
            router.register_forward_hook(self._hook(li, checkpointed))
        self.moe_layers = sorted(self.routers)
        # MTP modules' routers (the last stage's, numbered after the decoder's layers as in
        # layer_map): the load-balancing losses reach them as megatron-core's reach every router;
        # never recomputed (slime.backends.megatron.mtp), never replayed or recorded
        mtp = getattr(model, "mtp", None)
        for k, layer in enumerate(mtp.layers if mtp is not None else ()):
            router = getattr(layer.transformer_layer.mlp, "router", None)
            if isinstance(router, TopKRouter):
                self.routers[num_layers + k] = router
                router.register_forward_hook(self._hook(num_layers + k, False))

    @classmethod
    def install(
        cls,
        model: Any,
        layout: Any,
        hf_config: Any,
        recompute: dict[str, Any],
        mesh: Any,
        sequence_parallel: bool,
    ) -> MegatronRouting | None:
        """The hooks on a mixture-of-experts model's routers (None for a dense model, and for a
        family whose routing they do not follow: megatron-core's router routes it, untouched)."""
        from slime.backends.megatron.settings import router_hooks

        if not layout.num_experts or not router_hooks(layout):
            return None
        from slime.config.architecture import hf_moe

        moe = hf_moe(hf_config)
        sp = mesh.tp if sequence_parallel else 1
        return cls(
            model,
            layout.num_layers,
            moe["moe_router_topk"],
            layout.num_experts,
            renormalize=not moe["moe_router_pre_softmax"],
            recompute=recompute,
            sp_group=mesh.tp_group,
            sp_rank=mesh.tp_rank if sp > 1 else 0,
            sp_size=sp,
            score_function=moe["moe_router_score_function"],
        )

    # ---- per micro-batch --------------------------------------------------------------------
    def router_order(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        return router_order(x, rows, self.sp_rank, self.sp_size)

    def from_router_order(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        return from_router_order(x, rows, self.sp_group, self.sp_size)

    def begin(self, state: MicroBatchRouting | None) -> None:
        """The next forward is of the micro-batch `state` describes (None: nothing to do)."""
        self.current = state

    def states(
        self,
        mbs: list[MicroBatch],
        tables: dict[int, torch.Tensor] | None,
        record: bool = False,
        aux_coeff: float = 0.0,
        step_samples: int = 0,
        per_sequence: bool = False,
    ) -> list[MicroBatchRouting | None]:
        """The hooks' state for each micro-batch (None when nothing is asked): replay of `tables`
        (R2/R3), recording (R2's log-prob pass), the aux loss (a training step of `step_samples`;
        `per_sequence`: seq_aux_loss)."""
        if tables is None and not record and aux_coeff == 0:
            return [None] * len(mbs)
        states: list[MicroBatchRouting | None] = []
        for mb in mbs:
            rows, tokens = mb.input_ids.shape[0], mb.input_ids.numel()
            state = MicroBatchRouting(record={} if record else None)
            if tables is not None:
                state.replay = self.router_order(
                    self.replay_rows(tables, mb.positions, mb.token_starts(), tokens), rows
                )
            if aux_coeff > 0:
                ids = self.router_order(mb.sample_ids(torch.device("cpu")), rows)
                real = real_token_index(ids)
                state.real = transfer.to_device(real, mb.input_ids.device)
                state.aux_coeff, state.num_samples, state.step_samples = (
                    aux_coeff,
                    mb.num_samples,
                    step_samples,
                )
                if per_sequence:
                    state.samples = transfer.to_device(ids[real], mb.input_ids.device)
            states.append(state)
        return states

    def end_pass(self, completed: bool = True) -> None:
        """After a pass over the micro-batches: every recomputed layer has used its states
        (checked when the pass `completed`; after an error they are dropped)."""
        self.current = None
        leftover = {li: len(q) for li, q in self.queues.items() if q}
        for q in self.queues.values():
            q.clear()
        if completed and leftover:
            raise RuntimeError(f"recomputed MoE layers left micro-batches' routing behind: {leftover}")

    def recorded(self, mbs: list[MicroBatch], states: list[MicroBatchRouting | None]) -> list[torch.Tensor]:
        """The experts recorded in a pass, per micro-batch [tokens, layers, k] over its input ids
        flattened (row-major), on the host; -1 in dense layers and in other stages' layers. Each
        table's copy down starts without a wait (one table on the device at a time); the host
        waits once, for the last."""
        copies = []
        for mb, state in zip(mbs, states):
            assert state is not None and state.record is not None
            device = next((e.device for e in state.record.values()), torch.device("cpu"))
            shape = (mb.input_ids.numel(), self.num_layers, self.top_k)
            out = torch.full(shape, -1, dtype=torch.long, device=device)
            for li, experts in state.record.items():
                out[:, li] = self.from_router_order(experts, mb.input_ids.shape[0])
            copies.append(transfer.to_host_async(out))
        return [copy.wait() for copy in copies]

    # ---- the hook ---------------------------------------------------------------------------
    def _hook(self, li: int, checkpointed: bool) -> Any:
        def hook(module: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            state = self.current
            if checkpointed and module.training:
                if torch.is_grad_enabled():  # the backward pass recomputes the layer
                    state = self.queues[li].popleft()
                else:  # the checkpointed forward (no autograd): backward will come for it
                    self.queues[li].append(state)
            if state is None or not state.active:
                return None
            return self._route(li, module, args[0], output, state)

        return hook

    def _route(
        self, li: int, module: Any, hidden: torch.Tensor, output: Any, state: MicroBatchRouting
    ) -> Any:
        probs, routing_map = output
        aux = state.aux_coeff > 0 and module.training and torch.is_grad_enabled()
        if state.replay is not None or aux:
            logits = module.gating(hidden).reshape(-1, self.num_experts)  # megatron-core's router dtype
            wide = torch.float64 if logits.dtype == torch.float64 else torch.float32
            if self.score_function == "sigmoid":  # (the load-balancing losses only: its routing stays)
                scores, routed = sigmoid_aux_routing(logits, self.top_k)
            else:
                scores, routed = torch.softmax(logits, dim=-1, dtype=wide), None
            if state.replay is not None and li < self.num_layers:
                replay = transfer.to_device(state.replay[:, li].contiguous(), scores.device)
                if self.score_function == "sigmoid":  # -1: the router's own choice (bias, groups)
                    own = torch.topk(routing_map.to(torch.float32), self.top_k, dim=-1).indices
                    experts = torch.where(replay >= 0, replay, own)
                    scale = module.config.moe_router_topk_scaling_factor or 1.0
                    # (megatron-core renormalises a sigmoid router's top k whenever k > 1)
                    weights = sigmoid_weights(logits, experts, self.top_k > 1, scale)
                else:
                    weights, experts = choose(scores, self.top_k, replay, self.renormalize)
                probs = torch.zeros_like(probs).scatter(1, experts, weights.to(probs.dtype))
                routing_map = torch.zeros_like(routing_map).scatter(1, experts, True)
            if aux:
                real = state.real
                assert real is not None
                group = self.sp_group if self.sp_size > 1 else None
                routed = routing_map if routed is None else routed
                kept, chosen = scores.index_select(0, real), routed.index_select(0, real)
                if state.samples is not None:  # seq_aux_loss: each sample's own, over the step's samples
                    loss = (
                        sequence_balancing_loss(
                            kept, chosen, state.samples, state.num_samples, self.top_k, group
                        )
                        / state.step_samples
                    )
                else:
                    loss = load_balancing_loss(kept, chosen, self.top_k, group) * state.aux_share
                state.aux_sum = state.aux_sum + loss.detach()
                from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

                probs = MoEAuxLossAutoScaler.apply(probs, loss * state.aux_coeff)
        if state.record is not None and li < self.num_layers:  # the k experts of each row, ascending
            chosen = torch.topk(routing_map.to(torch.float32), self.top_k, dim=-1).indices
            state.record[li] = chosen.sort(dim=-1).values
        return probs, routing_map


def padding_mask(mb: MicroBatch, scatter: bool) -> torch.Tensor:
    """megatron-core's padding mask of micro-batch `mb` (true at padding, [rows, length]), which
    its routers take to count only real tokens for the expert-bias update
    (slime.backends.expert_bias). `scatter`: split it over the sequence-parallel ranks here
    (megatron-core does so on the first pipeline stage only)."""
    return sequence_parallel_share(~mb.real_tokens().view_as(mb.input_ids), scatter)


def sequence_parallel_share(mask: torch.Tensor, scatter: bool) -> torch.Tensor:
    """A [rows, length] token mask, with `scatter` this sequence-parallel rank's share of it."""
    if scatter:
        from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

        mask = scatter_to_sequence_parallel_region(mask.transpose(0, 1).contiguous()).transpose(0, 1)
    return mask.contiguous()


def update_expert_bias(model: Any, rate: float) -> None:
    """--moe-router-bias-update-rate after an optimizer step: every router's bias from the step's
    token counts that megatron-core's routers kept (`local_tokens_per_expert`), summed over this
    stage's TP x CP x DP ranks (every rank that routed a share of the step's tokens), as
    megatron-core sums them; then the counts start again (megatron-core counts with every
    training forward, whatever the rate: 0 only clears them)."""
    routers = [m for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    if not routers:
        return
    if rate > 0:
        from megatron.core import parallel_state as ps

        from slime.backends.expert_bias import update_biases

        update_biases(
            [r.expert_bias for r in routers],
            [r.local_tokens_per_expert for r in routers],
            rate,
            ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
        )
    for router in routers:
        router.local_tokens_per_expert.zero_()
