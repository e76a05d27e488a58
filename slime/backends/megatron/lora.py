"""LoRA on the Megatron actor: PEFT's adapters, kept as Hugging Face tensors, on megatron-core's
linear layers (`--lora-rank` with `--train-backend megatron`).

The adapters are the ones the FSDP actor trains: PEFT injected into transformers' model of
--hf-checkpoint (built on the meta device, nothing read) says which modules get one and their
shapes, and they start as PEFT starts them (slime.backends.fsdp.lora: fresh from --seed, or a
--lora-adapter-path directory). Each HF module's A [r, in] and B [out, r] is one parameter,
whole on every rank of its pipeline stage.

megatron-core fuses and splits the HF modules (q, k and v in one `linear_qkv` grouped by query
group, [gate; up] in `linear_fc1`, each cut over the tensor-parallel ranks). Which HF row and
column each element of a rank's weight is, is found by running the checkpoint conversion itself
(slime.backends.megatron.layer_map, sharding.split_tp) on index tensors, so every layer kind the
conversion knows is placed the way its weights are. A forward hook on each such layer adds
scaling * B A x, in one of two shapes:

- column (the layer's input whole, its output rows this rank's): A x on the whole input (under
  sequence parallelism gathered first, as the layer does), then this rank's rows of B. The input
  gradient is summed over TP as the layer sums its own (copy_to_tensor_model_parallel_region).
- row (the input's columns split over TP, the output whole: linear_proj, linear_fc2): this rank's
  columns of A, the partial products summed over TP, then B (under sequence parallelism the
  output cut to this rank's part of the sequence, as the layer's).

Gradients: a rank computes a part of A's and B's where it holds part of the layer (summed over
TP: `tp_partial`), the whole where it holds the layer whole (equal on every rank:
`average_over_tp`); slime.backends.megatron.grads reduces them so.

The base weights are frozen; only the adapters train. The reference pass runs with the adapters
off (`enabled`), the base model. The push merges W + scaling * B A in HF names (as
slime.backends.fsdp.lora.merged, PEFT's merge), or sends the adapters alone under PEFT's names.
Transformer Engine's fused layer-norm linears take the input before the norm: not built here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slime.backends.fsdp import lora as peft_lora
from slime.backends.megatron.layer_map import layer_pairs
from slime.backends.megatron.sharding import split_tp
from slime.config.lora import LoRAConfig
from slime.utils.errors import UsageError

_BITS = 21  # an index tensor's element: module id << 42 | HF row << 21 | HF column
_MASK = (1 << _BITS) - 1


@dataclass
class Target:
    """One megatron-core linear layer of this rank and the HF modules whose adapters it takes."""

    module: str  # the layer's name in this rank's model
    kind: str  # "column" or "row" (module docstring)
    modules: list[str]  # the HF modules, in the order of `rows`' ids
    rows: list[torch.Tensor]  # per HF module: its rows (HF numbering) this rank's output holds
    order: torch.Tensor  # column: the output's columns from cat([each module's rows..., zero])
    cols: torch.Tensor | None  # row: the HF input columns of this rank's input
    whole: bool  # the rank holds the whole layer (TP 1, or a layer TP leaves whole)


def hf_adapters(hf_config: Any, cfg: LoRAConfig, seed: int) -> dict[str, torch.Tensor]:
    """PEFT's adapters of --hf-checkpoint's transformers model ("<module>.lora_A.default.weight"),
    fresh from `seed` or read from --lora-adapter-path, as the FSDP actor starts them."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    model = peft_lora.inject(model, cfg)
    if cfg.adapter_path:
        return peft_lora.read_adapter(cfg.adapter_path, model, cfg)
    return peft_lora.fresh_adapters(model, seed)


def plan(
    layout: Any, shapes: dict[str, tuple[int, ...]], tp: int, tp_rank: int, layers: range
) -> list[Target]:
    """The targets of this rank (its stage's `layers`, its TP part) for the HF modules of
    `shapes` (module -> its weight's [out, in]); UsageError naming a module no layer takes."""
    ids = {m: k for k, m in enumerate(shapes)}
    found: set[str] = set()
    targets = []
    for i in layers:
        for pair in layer_pairs(layout, i, range(0)):
            hit = [n.removesuffix(".weight") for n in pair.hf if n.removesuffix(".weight") in ids]
            if not pair.mc.endswith(".weight") or not hit:
                continue
            index = [_index(n, s, ids) for n, s in zip(pair.hf, pair.shapes, strict=True)]
            full = pair.to_megatron(index, layout.num_query_groups)
            local = split_tp({pair.mc: full}, layout, tp)[tp_rank][pair.mc]
            name = pair.mc.removesuffix(".weight").replace(
                f"decoder.layers.{i}.", f"decoder.layers.{i - layers.start}.", 1
            )
            targets.append(_target(name, local, hit, ids, shapes))
            found.update(hit)
    missing = sorted(m for m in shapes if layer_of(m) in layers and m not in found)
    if missing:
        raise UsageError(
            f"LoRA on {missing[0]} is not built with --train-backend megatron: no megatron-core layer holds "
            "it (use --train-backend fsdp, or --target-modules without it)"
        )
    return targets


def layer_of(module: str) -> int | None:
    """The decoder layer an HF module sits in (None: outside the layers, e.g. lm_head)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return None


def _index(hf_name: str, shape: tuple[int, ...], ids: dict[str, int]) -> torch.Tensor:
    module = hf_name.removesuffix(".weight")
    if module not in ids:
        return torch.full(shape, -1, dtype=torch.int64)
    out, inp = shape
    if max(out, inp) > _MASK:
        raise UsageError(f"LoRA on {module}: {shape} is past the {_MASK + 1} rows or columns placed here")
    rows = torch.arange(out, dtype=torch.int64)[:, None] << _BITS
    return (ids[module] << (2 * _BITS)) | rows | torch.arange(inp, dtype=torch.int64)[None, :]


def _target(
    name: str, local: torch.Tensor, hit: list[str], ids: dict[str, int], shapes: dict[str, tuple[int, ...]]
) -> Target:
    """The shape of the adapters on one layer, read off its index tensor (module docstring)."""
    mid, row, col = local >> (2 * _BITS), (local >> _BITS) & _MASK, local & _MASK
    targeted = mid[:, 0] >= 0
    hf_in = shapes[hit[0]][1]
    whole_input = local.shape[1] == hf_in and bool((col[targeted] == torch.arange(hf_in)).all())
    per_row = bool((mid == mid[:, :1]).all()) and bool((row == row[:, :1]).all())
    modules = [m for m in ids if m in hit]
    if whole_input and per_row:
        rows, order, offset = [], torch.full((local.shape[0],), -1, dtype=torch.int64), 0
        for m in modules:
            mine = (mid[:, 0] == ids[m]).nonzero()[:, 0]
            rows.append(row[mine, 0])
            order[mine] = torch.arange(offset, offset + len(mine))
            offset += len(mine)
        order[order < 0] = offset  # rows of a module without an adapter: the zero column
        whole = all(len(r) == shapes[m][0] for m, r in zip(modules, rows, strict=True))
        return Target(name, "column", modules, rows, order, None, whole)
    whole_output = len(modules) == 1 and local.shape[0] == shapes[modules[0]][0]
    if whole_output and per_row and bool((mid == ids[modules[0]]).all()) and bool((col == col[:1]).all()):
        return Target(name, "row", modules, [row[:, 0]], torch.empty(0), col[0], whole=False)
    raise UsageError(
        f"LoRA on {', '.join(hit)} is not built with --train-backend megatron: megatron-core's {name} "
        "holds them in a layout the adapters are not placed in (use --train-backend fsdp, or "
        "--target-modules without them)"
    )


class MegatronLoRA(nn.Module):
    """The adapters of one pipeline stage and the hooks that apply them (module docstring)."""

    def __init__(self, adapters: dict[str, torch.Tensor], targets: list[Target], cfg: LoRAConfig):
        super().__init__()
        self.scaling, self.dropout, self.enabled = cfg.scaling, cfg.dropout, True
        self.names: list[str] = []  # PEFT's model-side names, in the order of `weights`
        self.weights = nn.ParameterList()
        index: dict[str, int] = {}
        for target in targets:
            for module in target.modules:
                for which in ("A", "B"):
                    name = f"{module}.lora_{which}.default.weight"
                    index[name] = len(self.names)
                    self.names.append(name)
                    p = nn.Parameter(adapters[name].clone())
                    if target.kind == "row":
                        p.tp_partial = which == "A"  # type: ignore[attr-defined]
                        p.average_over_tp = which == "B"  # type: ignore[attr-defined]
                    else:
                        p.tp_partial = not target.whole  # type: ignore[attr-defined]
                        p.average_over_tp = target.whole  # type: ignore[attr-defined]
                    self.weights.append(p)
        self.targets = targets
        self.initial = [adapters[name] for name in self.names]  # (float32, before a --bf16 cast)
        self._index = index

    def pair(self, module: str) -> tuple[nn.Parameter, nn.Parameter]:
        return (
            self.weights[self._index[f"{module}.lora_A.default.weight"]],
            self.weights[self._index[f"{module}.lora_B.default.weight"]],
        )

    def attach(self, model: nn.Module) -> None:
        """A forward hook on each target layer of `model` (this stage's GPTModel)."""
        layers = dict(model.named_modules())
        for target in self.targets:
            if target.module not in layers:
                raise UsageError(
                    f"LoRA on {', '.join(target.modules)}: this model has no layer {target.module!r} to "
                    "put the adapters on (use --train-backend fsdp)"
                )
            layers[target.module].register_forward_hook(self._hook(target))

    def _hook(self, target: Target) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if not self.enabled:
                return None
            out = output[0] if isinstance(output, tuple) else output
            x = args[0]
            sp = bool(getattr(module, "sequence_parallel", False))
            delta = self._column(target, x, sp) if target.kind == "column" else self._row(target, x, sp)
            out = out + (self.scaling * delta).to(out.dtype)
            return (out, *output[1:]) if isinstance(output, tuple) else out

        return hook

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, self.dropout, self.training) if self.dropout else x

    def _column(self, target: Target, x: torch.Tensor, sp: bool) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        if sp:  # the layer gathers the sequence first; the gradient is reduce-scattered back
            x = mappings.gather_from_sequence_parallel_region(x)
        elif not target.whole:  # the input gradient summed over TP, as the layer's own
            x = mappings.copy_to_tensor_model_parallel_region(x)
        parts = []
        for module, rows in zip(target.modules, target.rows, strict=True):
            a, b = self.pair(module)
            parts.append(self._drop(x) @ a.t() @ b.index_select(0, rows.to(b.device)).t())
        parts.append(x.new_zeros(*x.shape[:-1], 1))
        return torch.cat(parts, dim=-1).index_select(-1, target.order.to(x.device))

    def _row(self, target: Target, x: torch.Tensor, sp: bool) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        a, b = self.pair(target.modules[0])
        assert target.cols is not None
        z = self._drop(x) @ a.index_select(1, target.cols.to(a.device)).t()
        z = mappings.reduce_from_tensor_model_parallel_region(z)
        out = z @ b.index_select(0, target.rows[0].to(b.device)).t()
        return mappings.scatter_to_sequence_parallel_region(out) if sp else out

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """Context: the base model (the reference pass)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def initial_state(self) -> dict[str, torch.Tensor]:
        """The adapters as they start, under their names in the model (`lora_adapters.`)."""
        return {f"lora_adapters.weights.{k}": t for k, t in enumerate(self.initial)}

    def state(self) -> dict[str, torch.Tensor]:
        """This stage's adapters under PEFT's model-side names (detached)."""
        return {n: p.detach() for n, p in zip(self.names, self.weights, strict=True)}


def merged(
    named: Iterator[tuple[str, torch.Tensor]], adapters: dict[str, torch.Tensor], scaling: float
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors with each adapter merged into its base weight, W + scaling * B @ A (in float32,
    then W's dtype), as slime.backends.fsdp.lora.merged does (PEFT's merge)."""
    for name, t in named:
        module = name.removesuffix(".weight")
        a = adapters.get(f"{module}.lora_A.default.weight")
        if a is None or not name.endswith(".weight"):
            yield name, t
            continue
        b = adapters[f"{module}.lora_B.default.weight"].to(t.device)
        yield name, (t.float() + scaling * (b.float() @ a.to(t.device).float())).to(t.dtype)


def build(cfg: Any, layout: Any, hf_config: Any, mesh: Any, model: nn.Module) -> MegatronLoRA | None:
    """--lora-rank: this stage's adapters on `model` (registered as its `lora_adapters`, so they
    are saved, moved and cast with it), the base weights frozen; None without LoRA."""
    if not cfg.lora.enabled:
        return None
    if layout.fold_norms:
        from slime.config.lora import MEGATRON_TE

        raise UsageError(MEGATRON_TE)
    adapters = hf_adapters(hf_config, cfg.lora, cfg.seed)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in adapters.items():
        module, which = peft_lora.adapter_parts(name)
        out_in = shapes.setdefault(module, (0, 0))
        shapes[module] = (t.shape[0], out_in[1]) if which == "B" else (out_in[0], t.shape[1])
    outside = [m for m in shapes if layer_of(m) is None]
    if outside:
        raise UsageError(
            f"LoRA on {outside[0]} is not built with --train-backend megatron (adapters go on the decoder "
            "layers' linear layers); use --target-modules without it, or --train-backend fsdp"
        )
    layers = layout.stages(mesh.pp)[mesh.pp_rank]
    targets = plan(layout, shapes, mesh.tp, mesh.tp_rank, layers)
    for p in model.parameters():
        p.requires_grad_(False)
    adapter_module = MegatronLoRA(adapters, targets, cfg.lora)
    adapter_module.attach(model)
    model.add_module("lora_adapters", adapter_module)
    return adapter_module
