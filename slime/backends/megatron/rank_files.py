"""A model's megatron-core state dict split into the shards of a TP x PP x EP x ETP layout (one
per checkpoint file), and joined back. Pure tensor code, like slime.backends.megatron.convert.

A Megatron-LM checkpoint has one file per (TP rank, pipeline stage, EP rank):
`mp_rank_TT[_PPP][_EEE]` (slime.backends.megatron.checkpoint.rank_dir). Each file holds its
rank's dense shard (its TP part of its stage) and its experts (E / EP of them, numbered from 0,
each its ETP part). The ETP rank is not in the name: megatron-core numbers a stage's ranks with TP
(and ETP) fastest, so a rank's ETP rank is its TP rank modulo ETP when ETP divides TP (ETP 1:
every rank holds whole experts; ETP = TP: the TP rank). Other ETP sizes do not fit these names and
are refused (the actor's `--save` refuses them too).

A training run writes only the files of the ranks it has (with EP carved out of data
parallelism, not every (TP, EP) pair is a rank: TP 4 x EP 8 on 8 GPUs writes 8 of the 32); the
conversion tools write every pair, so any data-parallel size finds its rank's file.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from slime.backends.megatron.convert import ConversionError, Layout, State
from slime.backends.megatron.layer_map import is_expert
from slime.backends.megatron.sharding import (
    merge_experts,
    merge_pp,
    merge_tp,
    split_experts,
    split_pp,
    split_tp,
)

Key = tuple[int, int, int]
"""(TP rank, pipeline stage, EP rank): one checkpoint file."""


@dataclass(frozen=True)
class Parallel:
    """A TP x PP x EP x ETP layout (`etp` None: TP, as in Megatron-LM)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def check(self, layout: Layout) -> None:
        layout.check_parallel(self.tp, self.pp, self.ep, self.expert_tp)
        if layout.num_experts and self.tp % self.expert_tp:
            raise ConversionError(
                f"ETP {self.expert_tp} with TP {self.tp}: Megatron-LM's file names (mp_rank_TT[_PPP]_EEE) "
                "do not say a rank's ETP rank unless ETP divides TP; use ETP 1 or the tensor-parallel "
                "size"
            )

    def etp_rank(self, tp_rank: int) -> int:
        return tp_rank % self.expert_tp

    def keys(self) -> list[Key]:
        return [(t, s, e) for s in range(self.pp) for t in range(self.tp) for e in range(self.ep)]


def split_ranks(state: State, layout: Layout, par: Parallel) -> dict[Key, State]:
    """Every file's shard of an unsharded state dict (whole experts, global ids; the vocabulary
    padded for `par.tp`)."""
    par.check(layout)
    out: dict[Key, State] = {}
    for s, stage in enumerate(split_pp(state, layout, par.pp)):
        dense = split_tp({k: v for k, v in stage.items() if not is_expert(k)}, layout, par.tp)
        experts = {k: v for k, v in stage.items() if is_expert(k)}
        by_rank = split_experts(experts, layout, par.ep, par.expert_tp) if experts else {}
        for t, e in ((t, e) for t in range(par.tp) for e in range(par.ep)):
            out[(t, s, e)] = {**dense[t], **by_rank.get((e, par.etp_rank(t)), {})}
    return out


def merge_ranks(parts: Mapping[Key, State], layout: Layout, par: Parallel) -> State:
    """The unsharded state dict from the files of a layout: for each stage, one file per TP rank
    (dense tensors) and one per (EP rank, ETP rank) (experts); any others are not read."""
    par.check(layout)
    stages = []
    for s in range(par.pp):
        dense, experts = [], {}
        for t in range(par.tp):
            found = next((p for (pt, ps, _), p in parts.items() if (pt, ps) == (t, s)), None)
            if found is None:
                raise ConversionError(f"no shard of TP rank {t}, pipeline stage {s} (files {sorted(parts)})")
            dense.append({k: v for k, v in found.items() if not is_expert(k)})
        if layout.num_experts:
            for e in range(par.ep):
                for x in range(par.expert_tp):
                    found = next(
                        (
                            p
                            for (pt, ps, pe), p in parts.items()
                            if (ps, pe) == (s, e) and par.etp_rank(pt) == x
                        ),
                        None,
                    )
                    if found is None:
                        raise ConversionError(f"no shard of EP rank {e}, ETP rank {x}, pipeline stage {s}")
                    experts[(e, x)] = {k: v for k, v in found.items() if is_expert(k)}
        stage = merge_tp(dense, layout)
        if experts:
            stage.update(merge_experts(experts, layout))
        stages.append(stage)
    return merge_pp(stages, layout)


def shard(state: State, layout: Layout, tp: int, pp: int) -> dict[tuple[int, int], State]:
    """(TP rank, pipeline stage) -> its shard, experts whole (no EP, ETP 1)."""
    return {(t, s): part for (t, s, _), part in split_ranks(state, layout, Parallel(tp, pp, 1, 1)).items()}


def unshard(parts: Mapping[tuple[int, int], State], layout: Layout) -> State:
    """The inverse of `shard`."""
    tp, pp = 1 + max(t for t, _ in parts), 1 + max(s for _, s in parts)
    return merge_ranks({(t, s, 0): p for (t, s), p in parts.items()}, layout, Parallel(tp, pp, 1, 1))
