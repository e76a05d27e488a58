"""Gradient reduction and clipping for the Megatron actor (its own, not megatron-core's DDP).

- data-parallel: gradients are summed over the DP group (each rank's loss is already its share
  of the global batch, slime.algo.losses.token_weights), as the FSDP actor sums over its ranks;
- tensor-parallel: megatron-core's layers reduce their own activations; the QK-norm weights see
  only a rank's heads, and with sequence parallelism the norms (marked `sequence_parallel` by
  megatron-core) see only a rank's part of the sequence, so their gradients are summed over the
  TP group (as megatron-core's finalize_model_grads does); modules every TP rank computes whole
  (the gated delta-nets: `average_over_tp`) have their gradients averaged over it, so rounding
  differences between ranks never make the replicas drift; LoRA adapters on a layer cut over TP
  (`tp_partial`, slime.backends.megatron.lora) have theirs summed, each rank's being its part;
- pipeline with tied embeddings: the first stage's embedding and the last stage's output layer
  are one HF tensor; their gradients are summed over megatron-core's embedding group; so are the
  embedding's and the last stage's copy of it that its multi-token prediction modules read (they
  read it detached: the copy gets no gradient of its own, and takes the first stage's);
- experts (mixture-of-experts layers): each rank holds its EP rank's experts (its ETP part of
  them), which see only the tokens dispatched to them from the ranks of its expert-parallel group;
  the ranks that hold the same experts form megatron-core's expert data-parallel group, and the
  experts' gradients are summed over it instead of the DP group (as megatron-core's DDP does).

The norm counts every tensor of the full model once (TP-duplicated tensors on TP rank 0 only,
the last stage's copy of a tied embedding not at all), over the model-parallel group, plus every
expert tensor once (ETP-duplicated ones on ETP rank 0) over the expert tensor x model x pipeline
group, and clips as torch.nn.utils.clip_grad_norm_ does (coefficient max_norm / (norm + 1e-6),
applied below 1).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from slime.backends.megatron.convert import Layout
from slime.backends.megatron.export import Mesh
from slime.backends.megatron.layer_map import is_expert
from slime.backends.megatron.masters import MasterWeights
from slime.backends.megatron.moe import update_expert_bias

GradOf = Callable[[torch.Tensor], "torch.Tensor | None"]


def _grad(p: torch.Tensor) -> torch.Tensor | None:
    return p.grad


def reduce_gradients(
    model: Any,
    mesh: Mesh,
    dp_group: Any,
    qk_norm: bool,
    tied: bool,
    device: torch.device,
    grad_of: GradOf = _grad,
    *,
    ensure_grad: Callable[[torch.Tensor], torch.Tensor],
) -> None:
    """Sum what must be summed (see the module's text); `dp_group` None: one replica. `grad_of`
    maps a parameter to the gradient to reduce (--bf16: its float32 master's); `ensure_grad`
    too, making it zeros where there is none (MasterWeights.ensure_grad). `tied`: the last stage
    holds a copy of the embedding (tied embeddings, or MTP modules)."""
    from megatron.core import parallel_state as ps

    named = [(n, g) for n, p in model.named_parameters() if (g := grad_of(p)) is not None]
    if dp_group is not None:
        all_reduce_coalesced([g for n, g in named if not is_expert(n)], dp_group, device)
    if mesh.expert_dp_size > 1:
        all_reduce_coalesced([g for n, g in named if is_expert(n)], mesh.expert_dp_group, device)
    if mesh.tp > 1:
        params = dict(model.named_parameters())
        partial = [
            g
            for n, g in named
            if (qk_norm and ("q_layernorm" in n or "k_layernorm" in n))
            or getattr(params[n], "sequence_parallel", False)
            or getattr(params[n], "tp_partial", False)  # LoRA adapters on a split layer (megatron.lora)
        ]
        all_reduce_coalesced(partial, mesh.tp_group, device)
        replicated = [g for n, g in named if getattr(params[n], "average_over_tp", False)]
        all_reduce_coalesced(replicated, mesh.tp_group, device)
        for g in replicated:
            g.div_(mesh.tp)
    if mesh.pp > 1 and tied and (mesh.pp_rank in (0, mesh.pp - 1)):
        grad = ensure_grad(model.shared_embedding_or_output_weight())  # (both stages must take part)
        all_reduce_coalesced([grad], ps.get_embedding_group(), device)


def counted_once(
    model: Any, tp_rank: int, grad_of: GradOf = _grad, experts: bool = False, etp_rank: int = 0
) -> list[torch.Tensor]:
    """Gradients that enter the norm: each dense tensor of the full model exactly once (or with
    `experts`, each expert tensor)."""
    grads = []
    for name, p in model.named_parameters():
        grad = grad_of(p)
        # megatron-core marks the last stage's copy of a tied embedding `shared`.
        if grad is None or getattr(p, "shared", False) or is_expert(name) != experts:
            continue
        if getattr(p, "tensor_model_parallel", False) or (etp_rank if experts else tp_rank) == 0:
            grads.append(grad)
    return grads


def clip_gradients(
    model: Any, mesh: Mesh, clip_grad: float, device: torch.device, grad_of: GradOf = _grad
) -> float:
    """The global gradient norm (before clipping); clips to `clip_grad` (0: no clipping)."""
    from megatron.core import parallel_state as ps

    def sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
        square = torch.zeros(1, dtype=torch.float64, device=device)
        for g in grads:
            square += g.detach().double().pow(2).sum().to(device)
        return square

    square = sum_of_squares(counted_once(model, mesh.tp_rank, grad_of))
    if mesh.tp * mesh.pp > 1:
        dist.all_reduce(square, group=ps.get_model_parallel_group())
    if mesh.expert_mp_group is not None:
        experts = sum_of_squares(
            counted_once(model, mesh.tp_rank, grad_of, experts=True, etp_rank=mesh.etp_rank)
        )
        if mesh.ep * mesh.etp * mesh.pp > 1:
            dist.all_reduce(experts, group=mesh.expert_mp_group)
        square += experts
    norm = math.sqrt(float(square[0]))
    coef = (clip_grad or float("inf")) / (norm + 1e-6)
    if coef < 1.0:
        for p in model.parameters():
            grad = grad_of(p)
            if grad is not None:
                grad.mul_(coef)
    return norm


def all_reduce_coalesced(tensors: list[torch.Tensor], group: Any, device: torch.device) -> None:
    """Sum `tensors` over `group` through one flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = defaultdict(list)
    for t in tensors:
        by_dtype[t.dtype].append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same]).to(device)
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def optimizer_step(
    model: Any,
    mesh: Mesh,
    layout: Layout,
    grad_group: Any,
    masters: MasterWeights,
    device: torch.device,
    optimizer: torch.optim.Optimizer,
    schedule: Any,
    clip_grad: float,
    bias_rate: float,
) -> tuple[float, float]:
    """One optimizer step of a rank: its gradients reduced (over `grad_group`, DP x CP, and over
    TP where a parameter is replicated) and clipped, the optimizer and its schedule stepped on the
    --bf16 masters (copied back into the model), the routers' expert bias updated at `bias_rate`.
    Returns (grad_norm, the lr used)."""
    reduce_gradients(
        model,
        mesh,
        grad_group,
        layout.qk_norm,
        layout.tied_embeddings or bool(layout.mtp_layers),
        device,
        masters.grad_of,
        ensure_grad=masters.ensure_grad,
    )
    grad_norm = clip_gradients(model, mesh, clip_grad, device, masters.grad_of)
    lr = schedule.lr
    optimizer.step()
    schedule.step()
    masters.copy_back()
    update_expert_bias(model, bias_rate)
    return grad_norm, lr
