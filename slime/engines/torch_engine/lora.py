"""LoRA adapters served by the torch engine, several at once, each request choosing its own
(SGLang's `lora_path` field of /generate; /load_lora_adapter, /load_lora_adapter_from_tensors,
/unload_lora_adapter).

An adapter is, for some of the model's linear layers, a pair A [r, in], B [out, r] and a scaling
alpha / r (PEFT's LoRA): the layer's output gains scaling * (x A^T) B^T, in PEFT's order of
operations. The base weights are never changed; a forward hook on each adapted linear layer adds
the terms of the adapters its batch rows use (rows without an adapter get the base model), so the
engine's weight names, its weight updates and its checks stay those of the base model. A
mixture-of-experts layer's fused experts and router, which PEFT adapts as parameters
(`target_parameters`), get a forward of their own instead (slime.engines.torch_engine.lora_experts).

Why not PEFT here (the trainer uses it, slime.backends.fsdp.lora): PEFT's per-request adapters
(`adapter_names`) go through its PeftModel forward, while the batched runner drives the model's
modules one by one; and adapters arrive and leave at run time as tensors. The hook is the
smallest thing that serves them; the trainer's and the engine's outputs are compared in
tests/test_engine_lora.py.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from slime.engines.protocol import ProtocolError
from slime.engines.torch_engine import lora_experts
from slime.engines.torch_engine.lora_experts import ParamLoRA, TokenGroup
from slime.utils import peft_experts
from slime.utils.peft_experts import uniform_scaling
from slime.utils.peft_files import LORA_TENSOR, dump_name, read_adapter_dir


def read_dir(name: str, path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The config and tensors of a PEFT adapter directory (adapter_config.json,
    adapter_model.safetensors or .bin); ProtocolError naming the adapter when they cannot be read."""
    try:
        return read_adapter_dir(path)
    except Exception as e:  # a missing file, bad JSON, a truncated or foreign tensor file
        raise ProtocolError(
            f"cannot read LoRA adapter {name!r} from {path!r}: {type(e).__name__}: {e}", 400
        ) from None


@dataclass
class Adapter:
    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
    """Linear layer name -> (A [r, in], B [out, r]) in the model's dtype, on its device."""
    params: dict[str, dict[str, ParamLoRA]] = field(default_factory=dict)
    """Experts or router name -> its adapted parameters' factors (slime.engines.torch_engine.
    lora_experts)."""
    users: int = 0
    """Sequences admitted with this adapter and not finished yet."""
    unloading: bool = False
    """/unload_lora_adapter is waiting for its users: no new request may take it."""

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "path": self.path,
            "rank": self.rank,
            "scaling": self.scaling,
            "num_layers": len(self.weights) + sum(len(p) for p in self.params.values()),
        }


@dataclass
class ServedAdapters:
    """The engine's adapters by name, and the forward hooks that apply them."""

    model: Any
    max_loaded: int | None = None
    unapplied: tuple[str, ...] = ()
    """Linear layers the runner does not call as modules (multi-latent attention's kv_b_proj, in
    the absorbed form: slime.engines.torch_engine.layers), so an adapter on one is refused."""
    adapters: dict[str, Adapter] = field(default_factory=dict)
    _rows: list[tuple[Adapter, torch.Tensor]] | None = None
    _batch: int = 0
    """The number of batch rows of the forward `_rows` describe."""
    _tokens: dict[int, list[tuple[Adapter, torch.Tensor]]] = field(default_factory=dict)
    """Number of tokens -> each adapter's token indices in the current forward (`_token_rows`)."""
    _hooked: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        # Every linear layer of the decoder (by the name under which PEFT and SGLang address it,
        # from `layers.<i>.` on), and the LM head (`lm_head`: Tinker's train_unembed).
        self.linear: dict[str, tuple[str, nn.Linear]] = {}
        for name, module in self.model.named_modules():
            m = re.search(r"(layers\.\d+\..+|^lm_head)$", name)
            if isinstance(module, nn.Linear) and m is not None:
                self.linear[m.group(1)] = (name, module)
        self.experts_and_routers = lora_experts.adaptable(self.model)

    # ---- loading ------------------------------------------------------------------------------
    def load(
        self,
        name: str,
        config: dict[str, Any],
        tensors: dict[str, torch.Tensor],
        path: str,
        upsert: bool = False,
    ) -> None:
        """Register adapter `name` (refused if the name is taken: unload it first, as in SGLang).
        With `upsert` (the field of Miles's SGLang) a loaded adapter's weights are replaced in
        place: the requests running with it go on with the new ones (as paused requests do with
        new base weights)."""
        current = self.adapters.get(name) if upsert else None
        if current is None:
            self.check_new(name)
        rank, scaling = _rank_and_scaling(name, config)
        targets = config.get("target_parameters") or []
        targets = [targets] if isinstance(targets, str) else targets
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise ProtocolError(f"LoRA adapter {name!r}: 'target_parameters' must be a list of names", 400)
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        params: dict[str, dict[str, ParamLoRA]] = {}
        for module, ab in sorted(_pairs(name, tensors).items()):
            if set(ab) != {"A", "B"}:
                raise ProtocolError(f"LoRA adapter {name!r}: {module} has lora_{''.join(ab)} alone", 400)
            if module in self.linear:
                weights[module] = self._linear_pair(name, module, ab["A"][1], ab["B"][1], rank)
            else:
                found, param, lora = lora_experts.read_param_lora(
                    name, module, ab, self.experts_and_routers, targets
                )
                params.setdefault(found, {})[param] = lora
        if not weights and not params:
            raise ProtocolError(f"LoRA adapter {name!r} holds no LoRA weights", 400)
        self._serve(weights, params)
        if current is not None:
            current.path, current.rank, current.scaling = path, rank, scaling
            current.weights, current.params = weights, params
        else:
            self.adapters[name] = Adapter(name, path, rank, scaling, weights, params)

    def _linear_pair(
        self, name: str, module: str, a: torch.Tensor, b: torch.Tensor, rank: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A linear layer's (A, B), checked against the layer and copied to its dtype and device."""
        if module.rsplit(".", 1)[-1] in self.unapplied:
            raise ProtocolError(
                f"LoRA adapter {name!r}: {module} is computed in multi-latent attention's absorbed "
                "form, where this engine applies no adapter",
                400,
            )
        layer = self.linear[module][1]
        if tuple(a.shape) != (rank, layer.in_features) or tuple(b.shape) != (layer.out_features, rank):
            raise ProtocolError(
                f"LoRA adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; rank "
                f"{rank} needs A ({rank}, {layer.in_features}) and B ({layer.out_features}, {rank})",
                400,
            )
        w = layer.weight
        return a.to(w.device, w.dtype, copy=True), b.to(w.device, w.dtype, copy=True)

    def _serve(self, weights: dict[str, Any], params: dict[str, Any]) -> None:
        """Hook the linear layers and take over the experts' and routers' forwards an adapter
        adapts, once each (they serve the base model while no row uses an adapter on them)."""
        for module in weights:
            if module not in self._hooked:
                self.linear[module][1].register_forward_hook(self._hook(module))
                self._hooked.add(module)
        for module in params:
            if module not in self._hooked:
                target = self.experts_and_routers[module][1]
                serve = (
                    lora_experts.serve_experts
                    if peft_experts.is_fused_experts(target)
                    else lora_experts.serve_router
                )
                serve(target, module, self._token_groups)
                self._hooked.add(module)

    def check_new(self, name: str) -> None:
        if name in self.adapters:
            raise ProtocolError(f"LoRA adapter {name!r} is already loaded: unload it first", 400)
        if self.max_loaded is not None and len(self.adapters) >= self.max_loaded:
            raise ProtocolError(
                f"{len(self.adapters)} LoRA adapters are loaded, this engine's limit (--max-loaded-loras): "
                f"unload one of {sorted(self.adapters)}",
                400,
            )

    def load_dir(self, name: str, path: str) -> None:
        """A PEFT adapter directory (read_dir)."""
        self.check_new(name)
        self.load(name, *read_dir(name, path), path)

    def start_unload(self, name: str) -> None:
        """Refuse new requests for adapter `name` (as SGLang, which unregisters it first); it goes
        once its running requests finished (`unload`)."""
        adapter = self.adapters.get(name)
        if adapter is None or adapter.unloading:
            raise ProtocolError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self.adapters)})", 400)
        adapter.unloading = True

    def unload(self, name: str) -> bool:
        """Drop adapter `name` (after `start_unload`); False while sequences admitted with it still run."""
        adapter = self.adapters.get(name)
        if adapter is None:
            raise ProtocolError(f"LoRA adapter {name!r} is not loaded (loaded: {sorted(self.adapters)})", 400)
        if adapter.users:
            return False
        del self.adapters[name]
        return True

    def loaded(self) -> dict[str, str]:
        """SGLang's `loaded_adapters`: name -> path."""
        return {n: a.path for n, a in self.adapters.items()}

    def dump_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """Every loaded adapter's A and B as held (the model's dtype), under dump_name's names
        (--debug-sync-parameters-path)."""
        pairs = [(a.name, module, pair) for a in self.adapters.values() for module, pair in a.weights.items()]
        pairs += [
            (a.name, lora.module, lora.peft_layout())
            for a in self.adapters.values()
            for by_param in a.params.values()
            for lora in by_param.values()
        ]
        return [
            (dump_name(n, module, which), t)
            for n, module, pair in sorted(pairs, key=lambda p: p[:2])
            for which, t in zip("AB", pair)
        ]

    # ---- serving ------------------------------------------------------------------------------
    def resolve(self, name: str) -> Adapter:
        adapter = self.adapters.get(name)
        if adapter is None or adapter.unloading:
            loaded = sorted(n for n, a in self.adapters.items() if not a.unloading)
            raise ProtocolError(f"the requested LoRA adapter {name!r} is not loaded (loaded: {loaded})")
        return adapter

    @contextlib.contextmanager
    def rows(self, per_row: Sequence[Adapter | None]) -> Iterator[None]:
        """Context: the next forwards' batch rows use these adapters (None: the base model)."""
        groups: dict[int, tuple[Adapter, list[int]]] = {}
        for i, adapter in enumerate(per_row):
            if adapter is not None:
                groups.setdefault(id(adapter), (adapter, []))[1].append(i)
        device = next(iter(self.model.parameters())).device
        self._rows = [(a, torch.tensor(r, device=device)) for a, r in groups.values()] or None
        self._batch = len(per_row)
        try:
            yield
        finally:
            self._rows = None
            self._tokens.clear()

    def _token_rows(self, num_tokens: int) -> list[tuple[Adapter, torch.Tensor]]:
        """Each adapter of the current forward with the indices of its rows' tokens among
        `num_tokens`: the batch's tokens, flattened row-major when more than its rows."""
        if self._rows is None:
            return []
        out = self._tokens.get(num_tokens)
        if out is None:
            if num_tokens % self._batch:
                raise RuntimeError(f"LoRA: {num_tokens} tokens for {self._batch} batch rows")
            per_row = num_tokens // self._batch
            steps = torch.arange(per_row, device=self._rows[0][1].device)
            out = [(a, (rows[:, None] * per_row + steps).reshape(-1)) for a, rows in self._rows]
            self._tokens[num_tokens] = out
        return out

    def _token_groups(self, module: str, num_tokens: int) -> list[TokenGroup]:
        """lora_experts.Groups: the current forward's adapters that adapt experts or router `module`."""
        return [
            TokenGroup(a.scaling, a.params[module], tokens)
            for a, tokens in self._token_rows(num_tokens)
            if module in a.params
        ]

    def _hook(self, module: str) -> Any:
        def add_adapters(layer: nn.Module, args: tuple[Any, ...], out: torch.Tensor) -> torch.Tensor:
            if self._rows is None:
                return out
            x = args[0]
            if len(self._rows) == 1 and len(self._rows[0][1]) == self._batch:  # every row, one adapter
                adapter = self._rows[0][0]
                ab = adapter.weights.get(module)
                if ab is not None:  # as PEFT: lora_B(lora_A(x)) * scaling, added to the base output
                    out = out + F.linear(F.linear(x, ab[0]), ab[1]) * adapter.scaling
                return out
            # A layer may see the batch's tokens flattened, [rows x tokens, ...] (the shared
            # expert of a mixture-of-experts block): view them per row, row-major.
            view = out
            if x.shape[0] != self._batch:
                if x.shape[0] % self._batch:
                    raise RuntimeError(f"LoRA on {module}: {x.shape[0]} inputs for {self._batch} batch rows")
                x = x.view(self._batch, -1, *x.shape[1:])
                view = out.view(self._batch, -1, *out.shape[1:])
            for adapter, rows in self._rows:
                ab = adapter.weights.get(module)
                if ab is not None:
                    view[rows] = view[rows] + F.linear(F.linear(x[rows], ab[0]), ab[1]) * adapter.scaling
            return out

        return add_adapters


def _rank_and_scaling(name: str, config: dict[str, Any]) -> tuple[int, float]:
    """The adapter's rank r and its one scaling (slime.utils.peft_experts.uniform_scaling)."""
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_dora"):
        raise ProtocolError(
            f"LoRA adapter {name!r}: only plain LoRA is served (peft_type LORA, no DoRA)", 400
        )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ProtocolError(f"LoRA adapter {name!r}: its config needs 'r' (int >= 1) and 'lora_alpha'", 400)
    try:
        return rank, uniform_scaling(config)
    except (ValueError, TypeError, AttributeError, ZeroDivisionError) as e:  # another scaling; malformed
        raise ProtocolError(f"LoRA adapter {name!r}: {e}", 400) from None


def _pairs(name: str, tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, tuple[str, torch.Tensor]]]:
    """PEFT module name from `layers.<i>.` on -> {"A"|"B": (the tensor's stored name, tensor)}."""
    pairs: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}
    for key, t in tensors.items():
        m = LORA_TENSOR.match(key)
        if m is None:
            raise ProtocolError(
                f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A/B weight of a layer", 400
            )
        pairs.setdefault(m.group(1), {})[m.group(2)] = (key, t)
    return pairs
