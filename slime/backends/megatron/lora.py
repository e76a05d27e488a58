"""LoRA on the Megatron actor: PEFT's adapters, kept as Hugging Face tensors, on megatron-core's
linear layers (`--lora-rank` with `--train-backend megatron`).

The adapters are the ones the FSDP actor trains: PEFT injected into transformers' model of
--hf-checkpoint (built on the meta device, nothing read) says which modules get one and their
shapes, and they start as PEFT starts them (slime.backends.fsdp.lora: fresh from --seed, or a
--lora-adapter-path directory). Each HF module's A [r, in] and B [out, r] is one parameter,
whole on every rank of its pipeline stage.

megatron-core fuses and splits the HF modules (q, k and v in one `linear_qkv` grouped by query
group, [gate; up] in `linear_fc1`, each cut over the tensor-parallel ranks). Which HF rows a rank's
weight holds, and whether its columns are cut, is found by running the checkpoint conversion
itself (slime.backends.megatron.layer_map, sharding.split_tp) on small index tensors ([out, tp]:
the conversion moves whole rows, and cuts columns only into TP's parts), so every layer kind the
conversion knows is placed the way its weights are. A forward hook on each such layer adds
scaling * B A x, in one of two shapes:

- column (the layer's input whole, its output rows this rank's): A x, then this rank's rows of
  B. The input gradient is summed over TP as the layer sums its own
  (copy_to_tensor_model_parallel_region).
- row (the input's columns split over TP, the output whole: linear_proj, linear_fc2): this rank's
  columns of A, the partial products summed over TP, then B.

Sequence parallelism needs Transformer Engine here, whose fused layer-norm linears take the input
before the norm: LoRA is refused with it (so a MoE model's adapters run at TP 1). The embedding's
output asks for a gradient, so that megatron-core's full recompute (a reentrant checkpoint) gives
the adapters of every layer theirs.

Gradients: a rank computes a part of A's and B's where it holds part of the layer (summed over
TP: `tp_partial`), the whole where it holds the layer whole (equal on every rank:
`average_over_tp`); slime.backends.megatron.grads reduces them so.

The base weights are frozen; only the adapters train. The reference pass runs with the adapters
off (`enabled`), the base model. The push merges W + scaling * B A in HF names (as
slime.backends.fsdp.lora.merged, PEFT's merge), or sends the adapters alone under PEFT's names.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from slime.backends.fsdp import lora as peft_lora
from slime.backends.megatron import lora_experts
from slime.backends.megatron.layer_map import layer_of, layer_pairs
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

    def to(self, device: torch.device) -> None:
        """The index tensors on `device` (once: the hook reads them every forward)."""
        if self.order.device != device:
            self.rows = [r.to(device) for r in self.rows]
            self.order = self.order.to(device)
            self.cols = None if self.cols is None else self.cols.to(device)


@dataclass
class HFAdapters:
    """PEFT's adapters of --hf-checkpoint's transformers model, as the FSDP actor starts them."""

    tensors: dict[str, torch.Tensor]
    """"<module>.lora_A.default.weight" -> fresh from --seed or read from --lora-adapter-path"""
    wrapped: dict[str, str]
    """The modules on parameters (experts, routers) -> the parameter each adapts
    (slime.backends.megatron.lora_experts)"""
    config: Any
    """PEFT's config as injection completed it (adapter_config.json)"""


def hf_adapters(hf_config: Any, cfg: LoRAConfig, seed: int) -> HFAdapters:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    model = peft_lora.inject(model, cfg)
    if cfg.adapter_path:
        tensors = peft_lora.read_adapter(cfg.adapter_path, model, cfg)
    else:
        tensors = peft_lora.fresh_adapters(model, seed)
    return HFAdapters(tensors, peft_lora.wrapped_parameters(model), peft_lora.injected_config(model))


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
            index = [_index(n, s, ids, tp) for n, s in zip(pair.hf, pair.shapes, strict=True)]
            full = pair.to_megatron(index, layout.num_query_groups)
            local = split_tp({pair.mc: full}, layout, tp)[tp_rank][pair.mc]
            name = pair.mc.removesuffix(".weight").replace(
                f"decoder.layers.{i}.", f"decoder.layers.{i - layers.start}.", 1
            )
            targets.append(_target(name, local, hit, ids, shapes, tp))
            found.update(hit)
    missing = sorted(m for m in shapes if layer_of(m) in layers and m not in found)
    if missing:
        raise UsageError(
            f"LoRA on {missing[0]} is not built with --train-backend megatron: no megatron-core layer holds "
            "it (use --train-backend fsdp, or --target-modules without it)"
        )
    return targets


def _index(hf_name: str, shape: tuple[int, ...], ids: dict[str, int], tp: int) -> torch.Tensor:
    """An HF weight's stand-in: module id << 42 | row << 21 | j, [out, tp]. The conversion moves
    whole rows (fuses, groups, cuts them over TP) and cuts columns only into TP's equal parts, so
    `tp` columns tell a column cut (one left, j = the part) from a row cut (all left)."""
    module = hf_name.removesuffix(".weight")
    if module not in ids:
        return torch.full((shape[0], tp), -1, dtype=torch.int64)
    if shape[0] > _MASK:
        raise UsageError(f"LoRA on {module}: {shape[0]} rows, past the {_MASK + 1} placed here")
    rows = torch.arange(shape[0], dtype=torch.int64)[:, None] << _BITS
    return (ids[module] << (2 * _BITS)) | rows | torch.arange(tp, dtype=torch.int64)[None, :]


def _target(
    name: str,
    local: torch.Tensor,
    hit: list[str],
    ids: dict[str, int],
    shapes: dict[str, tuple[int, ...]],
    tp: int,
) -> Target:
    """The shape of the adapters on one layer, read off its index tensor (module docstring)."""
    mid, row, part = local >> (2 * _BITS), (local >> _BITS) & _MASK, local & _MASK
    modules = [m for m in ids if m in hit]
    per_row = bool((mid == mid[:, :1]).all()) and bool((row == row[:, :1]).all())
    if per_row and local.shape[1] == tp:  # the input whole: a column layer (or a layer left whole)
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
    if per_row and whole_output and bool((mid == ids[modules[0]]).all()):  # the input cut: a row layer
        cols = torch.arange(shapes[modules[0]][1]).chunk(tp)[int(part[0, 0])]
        return Target(name, "row", modules, [row[:, 0]], torch.empty(0), cols, whole=False)
    raise UsageError(
        f"LoRA on {', '.join(hit)} is not built with --train-backend megatron: megatron-core's {name} "
        "holds them in a layout the adapters are not placed in (use --train-backend fsdp, or "
        "--target-modules without them)"
    )


def key(name: str) -> str:
    """An adapter's key in the model (`lora_adapters.weights.<key>`): its PEFT name, dots dashed
    (a parameter's name holds none), so a checkpoint names what it holds."""
    return name.replace(".", "-")


class MegatronLoRA(nn.Module):
    """The adapters of one pipeline stage and the hooks that apply them (module docstring)."""

    def __init__(
        self,
        hf: HFAdapters,
        targets: list[Target],
        param_targets: list[lora_experts.ParamTarget],
        cfg: LoRAConfig,
    ):
        super().__init__()
        adapters = hf.tensors
        self.scaling, self.dropout, self.enabled = cfg.scaling, cfg.dropout, True
        self.wrapped, self.peft_config = hf.wrapped, hf.config
        self.weights = nn.ParameterDict()
        for module in dict.fromkeys(t.adapter for t in param_targets):  # whole on every rank
            for which in ("A", "B"):
                p = nn.Parameter(adapters[f"{module}.lora_{which}.default.weight"].clone())
                p.tp_partial, p.average_over_tp = False, True  # type: ignore[attr-defined]
                self.weights[key(f"{module}.lora_{which}.default.weight")] = p
        self.param_targets = param_targets
        for target in targets:
            for module in target.modules:
                for which in ("A", "B"):
                    p = nn.Parameter(adapters[f"{module}.lora_{which}.default.weight"].clone())
                    if target.kind == "row":
                        p.tp_partial = which == "A"  # type: ignore[attr-defined]
                        p.average_over_tp = which == "B"  # type: ignore[attr-defined]
                    else:
                        p.tp_partial = not target.whole  # type: ignore[attr-defined]
                        p.average_over_tp = target.whole  # type: ignore[attr-defined]
                    self.weights[key(f"{module}.lora_{which}.default.weight")] = p
        self.targets = targets
        # as they start, in float32 (before a --bf16 cast), for the master weights
        self.initial = {f"lora_adapters.weights.{k}": adapters[k.replace("-", ".")] for k in self.weights}

    def pair(self, module: str) -> tuple[nn.Parameter, nn.Parameter]:
        return (
            self.weights[key(f"{module}.lora_A.default.weight")],
            self.weights[key(f"{module}.lora_B.default.weight")],
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
        for param_target in self.param_targets:
            if param_target.module not in layers:
                raise UsageError(
                    f"LoRA on {param_target.adapter}: this model has no layer {param_target.module!r} to put "
                    "the adapter on (use --train-backend fsdp)"
                )
            lora_experts.hook(self, param_target, layers[param_target.module])

    def _hook(self, target: Target) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if not self.enabled:
                return None
            out = output[0] if isinstance(output, tuple) else output
            x = args[0]
            delta = self._column(target, x) if target.kind == "column" else self._row(target, x)
            out = out + (self.scaling * delta).to(out.dtype)
            return (out, *output[1:]) if isinstance(output, tuple) else out

        return hook

    def _drop(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.dropout(x, self.dropout, self.training) if self.dropout else x

    def _column(self, target: Target, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        if not target.whole:  # the input gradient summed over TP, as the layer's own
            x = mappings.copy_to_tensor_model_parallel_region(x)
        target.to(x.device)
        parts = []
        for module, rows in zip(target.modules, target.rows, strict=True):
            a, b = self.pair(module)
            parts.append(self._drop(x) @ a.t() @ b.index_select(0, rows).t())
        parts.append(x.new_zeros(*x.shape[:-1], 1))
        return torch.cat(parts, dim=-1).index_select(-1, target.order)

    def _row(self, target: Target, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        target.to(x.device)
        a, b = self.pair(target.modules[0])
        assert target.cols is not None
        z = self._drop(x) @ a.index_select(1, target.cols).t()
        z = mappings.reduce_from_tensor_model_parallel_region(z)
        return z @ b.index_select(0, target.rows[0]).t()

    @contextlib.contextmanager
    def off(self) -> Iterator[None]:
        """Context: the base model (the reference pass)."""
        self.enabled = False
        try:
            yield
        finally:
            self.enabled = True

    def state(self, masters: Any = None) -> dict[str, torch.Tensor]:
        """This stage's adapters under PEFT's model-side names (detached; with `masters`, --bf16's
        float32 master weights where they are)."""
        return {
            k.replace("-", "."): (masters[p] if masters is not None and p in masters else p).detach()
            for k, p in self.weights.items()
        }


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
    if cfg.lora.dropout and mesh.tp > 1:  # (each rank would draw its part of a row layer's mask alike)
        raise UsageError(
            f"--lora-dropout {cfg.lora.dropout} with --tensor-model-parallel-size {mesh.tp}: not built (the "
            "ranks of a row-parallel layer would draw the same mask for their parts of its input); use "
            "--lora-dropout 0 or TP 1"
        )
    hf = hf_adapters(hf_config, cfg.lora, cfg.seed)
    shapes: dict[str, tuple[int, ...]] = {}
    for name, t in hf.tensors.items():
        module, which = peft_lora.adapter_parts(name)
        if module in hf.wrapped:
            continue
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
    param_targets = lora_experts.plan(hf.wrapped, layers, layout.num_experts, mesh, layout.grouped_experts)
    for p in model.parameters():
        p.requires_grad_(False)
    adapter_module = MegatronLoRA(hf, targets, param_targets, cfg.lora)
    adapter_module.attach(model)
    model.add_module("lora_adapters", adapter_module)
    embedding = getattr(model, "embedding", None)
    if embedding is not None:
        # With everything before the first layer frozen, megatron-core's full recompute (a reentrant
        # checkpoint) would see no input needing a gradient and give the adapters inside none: the
        # embedding's output asks for one (as transformers' enable_input_require_grads).
        embedding.register_forward_hook(
            lambda m, a, out: out.requires_grad_(True) if torch.is_grad_enabled() else out
        )
    return adapter_module
