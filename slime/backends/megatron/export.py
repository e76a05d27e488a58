"""Stream a TP/PP-sharded megatron-core model to the weight bridge as HF-named buckets.

Collective over the whole job: every rank iterates `export_hf_tensors` (as every FSDP rank
iterates its export), in the same order of units (the embedding, layer 0 .. L-1, the final norm
and output layer). For each unit, the pipeline stage that owns it all-gathers its TP shards in
its TP group; its TP rank 0 then broadcasts the merged tensors to global rank 0 over the
pipeline group of TP rank 0 (receivers allocate from shapes known in advance); global rank 0
converts the unit to HF names (slime.backends.megatron.convert) and yields buckets. One code
path for every transport: the bridge on rank 0 only sees (HF name, full tensor) buckets, exactly
as from the FSDP actor. Only data-parallel rank 0's model takes part (replicas are identical).
For the CUDA-IPC push (`every_rank`), every rank assembles and yields the full tensors instead.
Padded vocabulary rows are dropped; a tied output layer is not exported (HF ties it). The
multi-token prediction modules (on the last stage) come last, only when asked (`with_mtp`: a
saved checkpoint has them, a weight push does not: no engine here runs them).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slime.backends.megatron.convert import (
    Layout,
    State,
    hf_to_megatron,
    layer_to_hf,
)
from slime.backends.megatron.layer_map import (
    expert_names,
    is_expert,
    layer_pairs,
    layer_prefix,
    mtp_shared_copies,
)
from slime.backends.megatron.sharding import merge_fc1, merge_tp

FLOAT32_KEPT = (".router.expert_bias",)
"""Tensors megatron-core keeps in float32 whatever the parameters' dtype (its router's expert bias)."""


@dataclass(frozen=True)
class Mesh:
    """Where this rank sits, and the groups the export uses (from megatron-core's parallel state)."""

    tp: int
    pp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    tp_group: Any
    pp_group: Any
    ep: int = 1
    etp: int = 1
    ep_rank: int = 0
    etp_rank: int = 0
    expert_dp_rank: int = 0
    expert_dp_size: int = 1
    ep_group: Any = None
    etp_group: Any = None
    expert_dp_group: Any = None
    """Experts are replicated over this group (megatron-core's expert data-parallel group)."""
    expert_mp_group: Any = None
    """ETP x EP x PP: every expert tensor of the model once (megatron-core's expert-tensor-model-pipeline
    group)."""
    cp_rank: int = 0
    """Context parallelism: the CP ranks of a replica hold the same weights (CP rank 0 exports them)."""

    @classmethod
    def from_parallel_state(cls) -> Mesh:
        from megatron.core import parallel_state as ps

        return cls(
            ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_pipeline_model_parallel_rank(),
            ps.get_data_parallel_rank(),
            ps.get_tensor_model_parallel_group(),
            ps.get_pipeline_model_parallel_group(),
            ps.get_expert_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_world_size(),
            ps.get_expert_model_parallel_rank(),
            ps.get_expert_tensor_parallel_rank(),
            ps.get_expert_data_parallel_rank(),
            ps.get_expert_data_parallel_world_size(),
            ps.get_expert_model_parallel_group(),
            ps.get_expert_tensor_parallel_group(),
            ps.get_expert_data_parallel_group(),
            ps.get_expert_tensor_model_pipeline_parallel_group(),
            ps.get_context_parallel_rank(),
        )


def full_shapes(layout: Layout, tp: int) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Every unsharded megatron-core tensor's shape (vocabulary padded for `tp`), computed on meta tensors."""
    hf = meta_hf_state(layout)
    return {k: (v.shape, v.dtype) for k, v in hf_to_megatron(hf, layout, tp).items()}


def meta_hf_state(layout: Layout, with_mtp: bool = True) -> State:
    """Every HF tensor of the model as a meta tensor of its shape (slime.backends.megatron.layer_map);
    without `with_mtp`, those of the decoder only (what a weight push sends)."""
    L, h = layout, layout.hidden_size
    meta: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (L.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not L.tied_embeddings:
        meta["lm_head.weight"] = (L.vocab_size, h)
    for i in L.all_layers if with_mtp else range(L.num_layers):
        for pair in layer_pairs(L, i):
            meta.update(zip(pair.hf, pair.shapes, strict=True))
        if i >= L.num_layers:
            meta.update({copy: meta[own] for copy, own in mtp_shared_copies(L, i).items()})
    return {k: torch.empty(shape, device="meta") for k, shape in meta.items()}


def _units(
    layout: Layout, names: list[str], pp: int, with_mtp: bool
) -> list[tuple[int, int | None, list[str]]]:
    """(owner stage, global layer or None, megatron names) in export order."""
    stages = layout.stages(pp)
    owner = {g: s for s, r in enumerate(stages) for g in r}
    units: list[tuple[int, int | None, list[str]]] = [(0, None, ["embedding.word_embeddings.weight"])]
    for i in range(layout.num_layers):
        prefix = f"decoder.layers.{i}."
        units.append((owner[i], i, [n for n in names if n.startswith(prefix)]))
    last = ["decoder.final_layernorm.weight"] + ([] if layout.tied_embeddings else ["output_layer.weight"])
    units.append((pp - 1, None, last))
    for i in range(layout.num_layers, layout.num_layers + layout.mtp_layers) if with_mtp else ():
        prefix = f"mtp.layers.{i - layout.num_layers}."
        units.append((pp - 1, i, [n for n in names if n.startswith(prefix)]))
    return units


def _local_name(name: str, layer: int | None, pp_rank: int, layout: Layout, pp: int) -> str:
    if layer is None or layer >= layout.num_layers:  # MTP modules keep their names on the last stage
        return name
    local = layer - layout.stages(pp)[pp_rank].start
    return name.replace(f"decoder.layers.{layer}.", f"decoder.layers.{local}.", 1)


def export_hf_tensors(
    local: State, layout: Layout, mesh: Mesh, every_rank: bool = False, with_mtp: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) on global rank 0, nothing elsewhere; with `every_rank`, on every
    rank (the CUDA-IPC push shares each rank's own copy with the engine on its GPU): then every
    replica assembles its own, and the owning stage broadcasts to every stage of each TP rank's
    pipeline. `local` is this rank's shard (its stage's layers numbered from 0, as in its
    GPTModel's state dict). Collective."""
    # Data-parallel ranks other than 0 hold experts no other rank has (expert parallelism is
    # carved out of data parallelism), so they take part in the expert gathers and nothing else.
    experts_only = (mesh.dp_rank != 0 or mesh.cp_rank != 0) and not every_rank
    if experts_only and mesh.ep * mesh.etp == 1:
        return
    shapes = full_shapes(layout, mesh.tp)
    receives = every_rank or mesh.tp_rank == 0  # who takes part in the pipeline broadcast
    yields = every_rank or (mesh.pp_rank == 0 and mesh.tp_rank == 0)  # global rank 0 of DP rank 0
    pp_ranks = dist.get_process_group_ranks(mesh.pp_group) if mesh.pp > 1 and receives else []
    own_tensors: State = {}  # the embedding and output head, for the MTP modules' copies
    for stage, layer, names in _units(layout, list(shapes), mesh.pp, with_mtp):
        gathered: State = {}
        if mesh.pp_rank == stage and layer is not None and layout.is_moe(layer):
            prefix = layer_prefix(layout, layer)
            gathered = _gather_experts(
                local, layout, mesh, layer, _local_name(prefix, layer, mesh.pp_rank, layout, mesh.pp)
            )
        if experts_only:
            continue
        merged: State = {}
        for name in names:
            tensor: torch.Tensor | None = None
            if mesh.pp_rank == stage:
                if is_expert(name):
                    tensor = gathered[name]
                else:
                    shard = local[_local_name(name, layer, mesh.pp_rank, layout, mesh.pp)]
                    tensor = _gather_tp(shard, name, layout, mesh)
            # Without every_rank only stage 0 (where rank 0 is) needs another stage's tensors.
            if mesh.pp > 1 and receives and (every_rank or stage != 0):
                shape, dtype = shapes[name]
                if tensor is None:
                    kept = torch.float32 if name.endswith(FLOAT32_KEPT) else local_dtype(local, dtype)
                    tensor = torch.empty(shape, dtype=kept, device=_device(local))
                dist.broadcast(tensor, src=pp_ranks[stage], group=mesh.pp_group)
            if yields:
                assert tensor is not None
                merged[name] = tensor
        if not yields:
            continue
        if layer is not None:
            yield from layer_to_hf(merged, layout, layer).items()
            if layer >= layout.num_layers:  # the MTP module's copies of the embedding and the head
                for copy, own in mtp_shared_copies(layout, layer).items():
                    yield copy, own_tensors[own].clone()
        elif "embedding.word_embeddings.weight" in merged:
            own_tensors["model.embed_tokens.weight"] = merged["embedding.word_embeddings.weight"][
                : layout.vocab_size
            ]
            yield "model.embed_tokens.weight", own_tensors["model.embed_tokens.weight"]
        else:
            yield "model.norm.weight", merged["decoder.final_layernorm.weight"]
            if "output_layer.weight" in merged:
                own_tensors["lm_head.weight"] = merged["output_layer.weight"][: layout.vocab_size]
                yield "lm_head.weight", own_tensors["lm_head.weight"]


def _gather_experts(local: State, layout: Layout, mesh: Mesh, layer: int, prefix: str) -> State:
    """Every expert of a MoE layer, whole, with global ids (HF order), on every rank of the stage:
    this rank's experts stacked, all-gathered over the ETP group (joined as split_experts split
    them), then over the EP group. `prefix`: the layer's name in this rank's state dict."""
    per = layout.num_experts // mesh.ep
    out: State = {}
    for which in (0, 1):  # fc1, fc2
        names = [expert_names(layout, layer, e)[which] for e in range(per)]
        local_names = [n.replace(layer_prefix(layout, layer), prefix, 1) for n in names]
        stacked = torch.stack([local[n] for n in local_names])
        if mesh.etp > 1:
            parts = [torch.empty_like(stacked) for _ in range(mesh.etp)]
            dist.all_gather(parts, stacked.contiguous(), group=mesh.etp_group)
            stacked = torch.stack(
                [
                    merge_fc1([p[j] for p in parts])
                    if which == 0
                    else torch.cat([p[j] for p in parts], dim=1)
                    for j in range(per)
                ]
            )
        ranks = [stacked]
        if mesh.ep > 1:
            ranks = [torch.empty_like(stacked) for _ in range(mesh.ep)]
            dist.all_gather(ranks, stacked.contiguous(), group=mesh.ep_group)
        for r, block in enumerate(ranks):
            for j in range(per):
                out[expert_names(layout, layer, r * per + j)[which]] = block[j]
    return out


def _gather_tp(shard: torch.Tensor, name: str, layout: Layout, mesh: Mesh) -> torch.Tensor:
    if mesh.tp == 1:
        return shard
    parts = [torch.empty_like(shard) for _ in range(mesh.tp)]
    dist.all_gather(parts, shard.contiguous(), group=mesh.tp_group)
    return merge_tp([{name: p} for p in parts], layout)[name]


def local_dtype(local: State, default: torch.dtype) -> torch.dtype:
    return next(iter(local.values())).dtype if local else default


def _device(local: State) -> torch.device:
    return next(iter(local.values())).device if local else torch.device("cpu")
