"""Checkpoint names vs. module parameter names of Hugging Face mixture-of-experts models.

transformers (>= 5) keeps the experts of each MoE layer as two fused parameters,
`mlp.experts.gate_up_proj` [E, 2*I, H] (gate rows, then up rows) and `mlp.experts.down_proj`
[E, H, I], but reads and writes checkpoints with one tensor per expert and projection
(`mlp.experts.{e}.gate_proj.weight` [I, H], `.up_proj.weight` [I, H], `.down_proj.weight` [H, I]).
Released checkpoints, SGLang's weight loaders and slime's conversion all use the per-expert
names, so slime speaks them everywhere outside a model object: weight pushes, `--save-hf`,
parameter dumps, fingerprints. This module is the one place that maps between the two.

transformers holds the same table (`transformers.conversion_mapping`), but as whole-tensor
operations run inside `from_pretrained`/`save_pretrained`. We need parts of it that those
cannot give: row ranges (each FSDP rank reads only its own experts from the files) and in-place
views (the engine writes one expert of a fused parameter), so the table is written out here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from slime.utils.model_families import FAMILIES
from slime.utils.peft_experts import unwrapped

# Model families whose transformers modeling fuses experts as described above (the families
# transformers maps with its "qwen2_moe" conversion rule and the same parameter names: those of
# slime.utils.model_families with fused_experts, and qwen2_moe itself). A family joins after a
# test shows its fused layout is this one (gpt-oss, for one, fuses differently: interleaved
# gate/up and transposed).
FUSED_EXPERT_FAMILIES = frozenset(
    {"qwen2_moe", *(f.model_type for f in FAMILIES.values() if f.fused_experts)}
)

# fused parameter suffix -> the per-expert projections stacked along its rows, in order
_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("mlp.experts.gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp.experts.down_proj", ("down_proj",)),
)


@dataclass(frozen=True)
class ExpertSlice:
    """Where one checkpoint tensor lives inside a fused parameter: `fused[expert, rows]`."""

    fused: str
    expert: int
    rows: slice

    def view(self, fused: torch.Tensor) -> torch.Tensor:
        return fused[self.expert, self.rows]

    def shape(self, fused_shape: Sequence[int]) -> tuple[int, ...]:
        """The checkpoint tensor's shape, given the fused parameter's."""
        return (self.rows.stop - self.rows.start, *fused_shape[2:])


def find_routers(layers: Sequence[Any]) -> dict[int, Any]:
    """Decoder layer index -> its router (`mlp.gate`), for the layers whose MLP is a routed
    mixture of experts in Hugging Face's modeling (a router with `top_k` and `num_experts`). A
    router PEFT wraps (LoRA on its weight) is its base module: a hook on it sees the adapted
    weight, which PEFT puts in place around the base module's forward."""
    out = {}
    for li, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None)
        gate: Any = getattr(mlp, "gate", None)
        if hasattr(gate, "get_base_layer"):
            gate = gate.get_base_layer()
        if hasattr(mlp, "experts") and hasattr(gate, "top_k") and hasattr(gate, "num_experts"):
            out[li] = gate
    return out


def _parts(name: str, shape: Sequence[int]) -> list[tuple[str, ExpertSlice]] | None:
    """The checkpoint tensors of fused parameter `name` (None when it is not one)."""
    for suffix, projections in _RULES:
        if name.endswith("." + suffix) and len(shape) == 3:
            prefix = name.rsplit(".", 1)[0]  # "...mlp.experts"
            rows = shape[1] // len(projections)
            return [
                (f"{prefix}.{e}.{proj}.weight", ExpertSlice(name, e, slice(k * rows, (k + 1) * rows)))
                for e in range(shape[0])
                for k, proj in enumerate(projections)
            ]
    return None


def fuses_experts(model_type: str | None) -> bool:
    return model_type in FUSED_EXPERT_FAMILIES


def checkpoint_slices(model_type: str | None, shapes: Mapping[str, Sequence[int]]) -> dict[str, ExpertSlice]:
    """Checkpoint name -> its place in a fused parameter, for every fused expert parameter among
    `shapes` (module parameter name -> shape). Empty for models that fuse nothing."""
    if not fuses_experts(model_type):
        return {}
    out: dict[str, ExpertSlice] = {}
    for name, shape in shapes.items():
        out.update(_parts(name, shape) or [])
    return out


def by_fused(slices: Mapping[str, ExpertSlice]) -> dict[str, list[tuple[str, ExpertSlice]]]:
    """The inverse of checkpoint_slices: fused name -> [(checkpoint name, slice)] in file order."""
    out: dict[str, list[tuple[str, ExpertSlice]]] = {}
    for name, where in slices.items():
        out.setdefault(where.fused, []).append((name, where))
    return out


def checkpoint_tensors(
    model_type: str | None, named: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(module name, tensor) pairs -> (checkpoint name, tensor) pairs: fused expert parameters
    become one view per expert and projection; everything else passes through."""
    fused = fuses_experts(model_type)
    for name, tensor in named:
        parts = _parts(name, tensor.shape) if fused else None
        if parts is None:
            yield name, tensor
        else:
            for part_name, where in parts:
                yield part_name, where.view(tensor)


def checkpoint_shapes(
    model_type: str | None, shapes: Mapping[str, Sequence[int]]
) -> dict[str, tuple[int, ...]]:
    """Module parameter shapes -> checkpoint tensor shapes (names as checkpoint_tensors gives)."""
    slices = checkpoint_slices(model_type, shapes)
    fused = {w.fused for w in slices.values()}
    out = {n: tuple(s) for n, s in shapes.items() if n not in fused}
    for name, where in slices.items():
        out[name] = where.shape(shapes[where.fused])
    return out


def persistent_buffers(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The buffers a checkpoint stores (those state_dict() holds: persistent, not rotary tables),
    by their checkpoint names: the routers' expert-score correction bias of DeepSeek-V3 and
    GLM-4.5 (`mlp.gate.e_score_correction_bias`), which aux-loss-free balancing moves. A module
    PEFT wraps (LoRA on a router) holds them under its `base_layer`, which the checkpoint lacks."""
    for module_name, module in model.named_modules():
        for name, buf in module._buffers.items():
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield unwrapped(f"{module_name}.{name}" if module_name else name), buf
