"""TP / EP / PP resharding of megatron-core (GPTModel) state dicts, with the names and layouts
slime.backends.megatron.convert describes: the vocabulary padded per TP, fused QKV and [gate; up]
fc1 split by rank, experts split over EP and ETP ranks, pipeline stages of consecutive layers
renumbered from 0. Pure tensor code: no megatron-core import, runs on CPU.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from slime.backends.megatron.convert import (
    ConversionError,
    Layout,
    State,
    embedding_to_megatron,
    final_to_megatron,
    layer_to_megatron,
    pad_rows,
)
from slime.backends.megatron.layer_map import expert_names, is_expert, parse_expert

# ---- tensor parallel ------------------------------------------------------------------------

_SPLIT_ROWS = re.compile(
    r"(word_embeddings\.weight|output_layer\.weight|linear_qkv\.(weight|bias)"
    r"|linear_q_proj\.weight|linear_q_up_proj\.weight|linear_kv_up_proj\.weight"  # MLA: whole heads per rank
    r"|eh_proj\.weight)$"  # MTP's projection: a column-parallel linear
)
_MLA_DOWN = re.compile(r"(linear_q_down_proj|linear_kv_down_proj)\.weight$")
"""MLA's latent projections: split by rows (and gathered) in megatron-core's local spec,
replicated in Transformer Engine's (`Layout.fold_norms`)."""


def _rows(name: str, layout: Layout) -> bool:
    return bool(_SPLIT_ROWS.search(name) or (not layout.fold_norms and _MLA_DOWN.search(name)))


_SPLIT_COLS = re.compile(r"(linear_proj\.weight|linear_fc2\.weight)$")
_FC1 = re.compile(r"linear_fc1\.weight$")


def split_tp(state: State, layout: Layout, tp: int) -> list[State]:
    """An unsharded megatron-core state dict (vocabulary padded for `tp`) as `tp` rank shards."""
    layout.check_parallel(tp, 1)
    shards: list[State] = [{} for _ in range(tp)]
    for name, t in state.items():
        if is_expert(name):  # split over EP x ETP ranks, not TP ones (split_experts)
            for whole in shards:
                whole[name] = t
            continue
        if ("word_embeddings" in name or name == "output_layer.weight") and t.shape[
            0
        ] != layout.padded_vocab_size(tp):
            # megatron-core builds VocabParallelEmbedding with padded_vocab_size(tp) / tp rows per rank.
            raise ConversionError(
                f"{name}: {t.shape[0]} vocabulary rows, but TP {tp} with --make-vocab-size-divisible-by "
                f"{layout.make_vocab_size_divisible_by} needs {layout.padded_vocab_size(tp)} "
                f"({layout.padded_vocab_size(tp) // tp} per rank); re-pad the vocabulary for this TP "
                "(repad_vocab)"
            )
        if _rows(name, layout):
            # QKV rows are whole query groups per rank (the grouped layout keeps each group together).
            parts = t.chunk(tp, dim=0)
        elif _SPLIT_COLS.search(name):
            parts = t.chunk(tp, dim=1)
        elif _FC1.search(name):
            parts = split_fc1(t, tp)
        else:
            parts = (t,) * tp
        for shard, part in zip(shards, parts, strict=True):
            shard[name] = part.clone()
    return shards


def merge_tp(shards: list[State], layout: Layout) -> State:
    """The inverse of split_tp; replicated tensors must agree across ranks."""
    out: State = {}
    for name in shards[0]:
        parts = [s[name] for s in shards]
        if is_expert(name):  # whole in every TP shard (merge_experts joins EP x ETP parts)
            out[name] = parts[0]
        elif _rows(name, layout):
            out[name] = torch.cat(parts, dim=0)
        elif _SPLIT_COLS.search(name):
            out[name] = torch.cat(parts, dim=1)
        elif _FC1.search(name):
            out[name] = merge_fc1(parts)
        else:
            for r, p in enumerate(parts[1:], start=1):
                if not torch.equal(p, parts[0]):
                    raise ConversionError(f"{name} is replicated but TP rank {r} differs from rank 0")
            out[name] = parts[0]
    return out


# ---- expert parallel ------------------------------------------------------------------------


def split_fc1(t: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    gate, up = t.chunk(2, dim=0)
    return tuple(torch.cat([g, u], dim=0) for g, u in zip(gate.chunk(n), up.chunk(n), strict=True))


def merge_fc1(parts: list[torch.Tensor]) -> torch.Tensor:
    halves = [p.chunk(2, dim=0) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def split_experts(state: State, layout: Layout, ep: int, etp: int) -> dict[tuple[int, int], State]:
    """The expert tensors of `state` (global ids, whole) as (EP rank, ETP rank) -> that rank's
    experts, numbered from 0, each split over ETP as a dense MLP over TP. Other tensors are left
    out (they follow TP: split_tp)."""
    layout.check_parallel(1, 1, ep, etp)
    per = layout.num_experts // ep if layout.num_experts else 1
    out: dict[tuple[int, int], State] = {(r, t): {} for r in range(ep) for t in range(etp)}
    for name, tensor in state.items():
        parsed = parse_expert(name, layout)
        if parsed is None:
            continue
        layer, e, which = parsed
        local = expert_names(layout, layer, e % per)[which]
        parts = split_fc1(tensor, etp) if which == 0 else tensor.chunk(etp, dim=1)
        for t, part in enumerate(parts):
            out[(e // per, t)][local] = part.clone()
    return out


def merge_experts(parts: Mapping[tuple[int, int], State], layout: Layout) -> State:
    """The inverse of split_experts: every (EP rank, ETP rank) part -> whole experts, global ids."""
    ep, etp = _grid(parts, "expert shards", "(EP rank, ETP rank)")
    per = layout.num_experts // ep
    out: State = {}
    for name in parts[(0, 0)]:
        parsed = parse_expert(name, layout)
        if parsed is None:
            continue
        layer, e, which = parsed
        for r in range(ep):
            pieces = [parts[(r, t)][name] for t in range(etp)]
            whole = merge_fc1(pieces) if which == 0 else torch.cat(pieces, dim=1)
            out[expert_names(layout, layer, r * per + e)[which]] = whole
    return out


def rank_shard(
    stage: State,
    layout: Layout,
    tp: int,
    tp_rank: int,
    ep: int = 1,
    etp: int = 1,
    ep_rank: int = 0,
    etp_rank: int = 0,
) -> State:
    """One rank's tensors of an unsharded pipeline stage: its TP part of the dense tensors and its
    EP x ETP part of the experts (`stage` may hold only some experts, with global ids)."""
    dense = {k: v for k, v in stage.items() if not is_expert(k)}
    out = split_tp(dense, layout, tp)[tp_rank] if dense else {}
    experts = {k: v for k, v in stage.items() if is_expert(k)}
    if experts:
        out.update(split_experts(experts, layout, ep, etp)[(ep_rank, etp_rank)])
    return out


def repad_vocab(state: State, layout: Layout, tp: int) -> State:
    """The vocabulary rows padded for another TP (real rows kept, padding zero)."""
    rows = layout.padded_vocab_size(tp)
    out = dict(state)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if name in out:
            out[name] = pad_rows(out[name][: layout.vocab_size], rows)
    return out


# ---- pipeline parallel ----------------------------------------------------------------------

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")


def split_pp(state: State, layout: Layout, pp: int) -> list[State]:
    """Stages with layers renumbered from 0; embedding on the first, final norm and output layer
    on the last (tied embeddings: the last stage gets `output_layer.weight`, a copy)."""
    layout.check_parallel(1, pp)
    stages: list[State] = [{} for _ in range(pp)]
    owner = {g: (s, g - r.start) for s, r in enumerate(layout.stages(pp)) for g in r}
    for name, t in state.items():
        m = _LAYER.match(name)
        if m:
            s, local = owner[int(m.group(1))]
            stages[s][f"decoder.layers.{local}.{m.group(2)}"] = t
        elif name.startswith("embedding."):
            stages[0][name] = t
            if layout.tied_embeddings and pp > 1:
                stages[-1]["output_layer.weight"] = t.clone()
            if layout.mtp_layers and pp > 1:  # the MTP modules' copy (megatron-core's, on their stage)
                stages[-1][name] = t.clone()
        else:
            stages[-1][name] = t
    return stages


def merge_pp(stages: list[State], layout: Layout) -> State:
    """The inverse of split_pp (a tied output layer on the last stage must equal the embedding)."""
    pp = len(stages)
    out: State = {}
    for s, (stage, layers) in enumerate(zip(stages, layout.stages(pp), strict=True)):
        for name, t in stage.items():
            m = _LAYER.match(name)
            if m:
                local = int(m.group(1))
                if local >= len(layers):
                    raise ConversionError(f"stage {s} holds {name}, but has only {len(layers)} layers")
                out[f"decoder.layers.{layers.start + local}.{m.group(2)}"] = t
            elif (name == "output_layer.weight" and layout.tied_embeddings) or (
                s == pp - 1 and s > 0 and name == "embedding.word_embeddings.weight"
            ):  # the last stage's copy of the embedding (tied, or read by the MTP modules)
                emb = stages[0].get("embedding.word_embeddings.weight")
                if emb is None or not torch.equal(emb, t):
                    raise ConversionError(f"the last stage's {name} differs from the first stage's embedding")
            else:
                out[name] = t
    return out


def _grid(parts: Mapping[tuple[int, int], Any], what: str, keys: str) -> tuple[int, int]:
    """The sizes of a two-dimensional grid of shards, refusing a hole in it."""
    rows, cols = 1 + max(a for a, _ in parts), 1 + max(b for _, b in parts)
    missing = [(a, b) for a in range(rows) for b in range(cols) if (a, b) not in parts]
    if missing:
        raise ConversionError(f"{what} missing for {keys} {missing}")
    return rows, cols


def hf_to_megatron_shard(
    hf: Mapping[str, torch.Tensor],
    layout: Layout,
    tp: int,
    pp: int,
    tp_rank: int,
    pp_rank: int,
    ep: int = 1,
    etp: int = 1,
    ep_rank: int = 0,
    etp_rank: int = 0,
    lm_head: bool = True,
) -> State:
    """One rank's shard, equal to `rank_shard(shard(hf_to_megatron(hf, layout, tp), layout, tp,
    pp)[(tp_rank, pp_rank)], ...)` with its EP / ETP part of the experts, but reading only the HF
    tensors of its stage (and only its own experts) and converting one layer at a time (with a
    lazy `hf` mapping, slime.backends.megatron.checkpoint.LazyHFState, a rank of a large model
    never holds more than one full layer beside its own shard)."""
    layout.check_parallel(tp, pp, ep, etp)
    layers = layout.stages(pp)[pp_rank]
    per = layout.num_experts // ep if layout.num_experts else 0
    mine_experts = range(ep_rank * per, (ep_rank + 1) * per)
    out: State = {}

    def keep(part: State, offset: int = 0) -> None:
        mine = rank_shard(part, layout, tp, tp_rank, ep, etp, ep_rank, etp_rank)
        for name, t in mine.items():
            m = _LAYER.match(name)
            out[f"decoder.layers.{int(m.group(1)) - offset}.{m.group(2)}" if m else name] = t

    if pp_rank == 0 or (pp_rank == pp - 1 and layout.mtp_layers):  # (the MTP modules' copy: split_pp)
        keep(embedding_to_megatron(hf, layout, tp))
    for i in layers:
        keep(layer_to_megatron(hf, layout, i, mine_experts), layers.start)
    if pp_rank == pp - 1:  # MTP modules: on the last stage, named as they are (megatron-core)
        for i in range(layout.num_layers, layout.num_layers + layout.mtp_layers):
            keep(layer_to_megatron(hf, layout, i, mine_experts))
    if pp_rank == pp - 1:  # without `lm_head` only the final norm (a critic's head is its own)
        final = final_to_megatron(hf, layout, tp, lm_head)
        if lm_head and layout.tied_embeddings and pp > 1:  # the last stage's copy of the embedding (split_pp)
            final["output_layer.weight"] = embedding_to_megatron(hf, layout, tp)[
                "embedding.word_embeddings.weight"
            ]
        keep(final)
    return out
