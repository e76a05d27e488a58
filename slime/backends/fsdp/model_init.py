"""Build a Hugging Face causal LM sharded with FSDP2, without ever holding the full model.

1. The module tree is built with its *parameters* on the meta device (buffers such as rotary
   frequencies are computed for real: they are small and not stored in checkpoints).
2. `fully_shard` is applied to every decoder layer, then to the root, so each parameter
   belongs to exactly one FSDP group.
3. Each rank allocates only its own shard and reads only its own rows of every tensor from
   the safetensors files (`get_slice`), so no rank ever holds more than one tensor's shard.

The result is bit-identical to a single-process `from_pretrained` in float32: the same bytes,
cast once, land in the same places.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
from torch import nn

from slime.backends.hf_checkpoint import CheckpointError, weight_files
from slime.utils import hf_experts

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Create every nn.Parameter on the meta device while buffers are built for real.

    Parameters are allocated uninitialised (torch.empty), moved to meta as they are registered,
    and the modules' initialisers then run on meta tensors (no work). Non-persistent buffers
    such as rotary inverse frequencies are not in checkpoints, so they must be real.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: the largest ModuleList in the model."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise CheckpointError(f"{type(model).__name__} has no nn.ModuleList of decoder layers to shard")
    largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    return list(largest.children())


def build_meta_model(config: Any, attn_implementation: str, value_head: bool = False) -> Any:
    """The model on the meta device: the causal LM, or (`value_head`) a value model, Hugging
    Face's *ForTokenClassification with one output (its `score` head) on the same transformer."""
    from transformers import AutoModelForTokenClassification

    from slime.utils.model_families import auto_model_class, is_vision, value_model_refusal

    if value_head and (problem := value_model_refusal(config.model_type)):
        raise CheckpointError(problem)
    if value_head:
        config = copy.deepcopy(config)
        config.num_labels = 1
        # Hugging Face puts a dropout of 0.1 before the head unless told; a value head has none
        # (slime's is a plain linear), and train-mode dropout would make values random.
        config.classifier_dropout = 0.0
    auto = AutoModelForTokenClassification if value_head else auto_model_class(config)
    attention: Any = attn_implementation
    if is_vision(config.model_type):  # the vision tower attends over its patches, never as packed text
        attention = {"text_config": attn_implementation, "vision_config": "sdpa"}
    with parameters_on_meta():
        model = auto.from_config(config, dtype=torch.float32, attn_implementation=attention)
    return model


def shard_model(
    model: nn.Module, mesh: Any, device: torch.device, mp_policy: Any, offload_policy: Any, shard: bool = True
) -> nn.Module:
    """fully_shard each decoder layer, then the root; then allocate this rank's shards. With
    `shard=False` (--debug-disable-sharding) only the allocation: a plain module."""
    from torch.distributed.fsdp import fully_shard

    kwargs = {"mesh": mesh, "mp_policy": mp_policy}
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    if shard:
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
        fully_shard(model, **kwargs)
    # to_empty also replaces buffers with uninitialised memory: keep the real ones.
    buffers = [(m, name, b) for m in model.modules() for name, b in m._buffers.items() if b is not None]
    model.to_empty(device=device)
    for module, name, buf in buffers:
        module._buffers[name] = buf.to(device)
    if not shard:  # to_empty gave tied parameters separate storage: tie them again
        cast(Any, model).tie_weights()
    return model


def shard_rows(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """Rows [start, end) of dim 0 that FSDP2's Shard(0) gives `rank` (torch.chunk semantics)."""
    chunk = -(-num_rows // world_size) if num_rows else 0
    start = min(rank * chunk, num_rows)
    return start, min(start + chunk, num_rows)


def local_tensor(param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly DTensor) parameter, as a plain tensor view."""
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param


class _CheckpointReader:
    """Reads rows of named tensors from safetensors files (or a mmapped .bin as fallback)."""

    def __init__(self, path: str):
        self.files = weight_files(path)
        self._where: dict[str, str] = {}
        self._bin: dict[str, torch.Tensor] = {}
        if self.files and self.files[0].endswith(".safetensors"):
            from safetensors import safe_open

            self._open = {f: safe_open(f, framework="pt") for f in self.files}
            for f, handle in self._open.items():
                for key in handle.keys():
                    self._where[key] = f
        else:
            for f in self.files:
                self._bin.update(torch.load(f, map_location="cpu", mmap=True, weights_only=True))
            self._where = dict.fromkeys(self._bin, "")

    def keys(self) -> set[str]:
        return set(self._where)

    def whole(self, key: str) -> torch.Tensor:
        if self._bin:
            return self._bin[key]
        return self._open[self._where[key]].get_tensor(key)

    def rows(self, key: str, start: int, end: int) -> torch.Tensor:
        if self._bin:
            t = self._bin[key]
            return t[start:end] if t.dim() else t
        tensor_slice = self._open[self._where[key]].get_slice(key)
        if len(tensor_slice.get_shape()) == 0:
            return tensor_slice[...]
        return tensor_slice[start:end]


def load_buffers(model: nn.Module, path: str) -> int:
    """Copy the persistent buffers the checkpoint at `path` stores into `model` (whole on every
    rank: FSDP does not shard buffers); returns how many. Without this they would keep their
    initial values (a zero expert-score bias instead of the checkpoint's)."""
    reader = _CheckpointReader(path)
    keys = reader.keys()
    count = 0
    with torch.no_grad():
        for name, buf in hf_experts.persistent_buffers(model):
            if name in keys:
                buf.copy_(reader.whole(name).to(buf.dtype))
                count += 1
    return count


def read_local_shards(
    model: nn.Module,
    path: str,
    rank: int,
    world_size: int,
    fresh: dict[str, torch.Tensor] | None = None,
    checkpoint_name: Callable[[str], str] | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's rows of every parameter of `model`, read from checkpoint dir `path`; those in
    `fresh` (whole tensors: a new value head, LoRA's adapters) come from there when the
    checkpoint lacks them. `checkpoint_name` maps a parameter's name to the checkpoint's (LoRA:
    the frozen linear of an adapted layer is its `base_layer`).

    Tied parameters appear once (under the name named_parameters() gives). Falls back to a
    full `from_pretrained` on CPU when the checkpoint's names differ from the module's (models
    whose loading renames or fuses tensors); that path holds one full copy per rank.
    """
    reader = _CheckpointReader(path)
    keys = reader.keys()
    rename = checkpoint_name or (lambda n: n)
    new = {n: t for n, t in (fresh or {}).items() if rename(n) not in keys}
    params = {rename(n): p for n, p in model.named_parameters() if n not in new}
    model_names = {rename(n): n for n, _ in model.named_parameters()}
    shards = {
        model_names[n]: t for n, t in _read_shards(reader, model, params, path, rank, world_size).items()
    }
    for name, whole in new.items():
        start, end = shard_rows(whole.shape[0], rank, world_size) if whole.dim() else (0, 0)
        shards[name] = (whole[start:end] if whole.dim() else whole).to(torch.float32).clone()
    for name, buf in hf_experts.persistent_buffers(model):  # whole on every rank (a reference's expert bias)
        if name in keys:
            shards[name] = reader.whole(name).to(buf.dtype)
    return shards


def _read_shards(
    reader: _CheckpointReader, model: nn.Module, params: dict[str, Any], path: str, rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    keys = reader.keys()
    # Fused expert parameters (MoE) are stored one tensor per expert: read this rank's experts.
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    shapes = {n: tuple(p.shape) for n, p in params.items() if n not in keys}
    per_expert = hf_experts.by_fused(hf_experts.checkpoint_slices(model_type, shapes))
    per_expert = {n: parts for n, parts in per_expert.items() if all(k in keys for k, _ in parts)}
    missing = [n for n in params if n not in keys and n not in per_expert]
    if missing:
        logger.warning(
            "checkpoint %s names %d parameters differently (e.g. %s); loading it whole with from_pretrained",
            path,
            len(missing),
            missing[0],
        )
        return _shards_via_from_pretrained(path, params, rank, world_size)
    shards = {}
    for name, param in params.items():
        start, end = shard_rows(param.shape[0], rank, world_size) if param.dim() else (0, 0)
        if name in per_expert:
            shards[name] = _read_experts(reader, per_expert[name], param.shape, start, end)
        else:
            shards[name] = reader.rows(name, start, end).to(torch.float32)
    return shards


def _read_experts(
    reader: _CheckpointReader,
    parts: list[tuple[str, hf_experts.ExpertSlice]],
    shape: Any,
    start: int,
    end: int,
) -> torch.Tensor:
    """Experts [start, end) of a fused parameter, assembled from their per-expert tensors."""
    out = torch.empty((end - start, *shape[1:]), dtype=torch.float32)
    for key, where in parts:
        if start <= where.expert < end:
            piece = reader.whole(key)
            expected = where.shape(shape)
            if tuple(piece.shape) != expected:
                raise CheckpointError(
                    f"checkpoint tensor {key} has shape {tuple(piece.shape)}, but the model's "
                    f"{where.fused} {tuple(shape)} needs {expected} (does the checkpoint match config.json?)"
                )
            out[where.expert - start, where.rows] = piece.to(torch.float32)
    return out


def _shards_via_from_pretrained(path: str, params: dict[str, Any], rank: int, world_size: int):
    from transformers import AutoConfig

    from slime.utils.model_families import auto_model_class

    full = auto_model_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.float32)
    state = dict(full.named_parameters())
    unknown = [n for n in params if n not in state]
    if unknown:
        raise CheckpointError(f"{path!r} does not provide parameters {unknown[:5]}")
    shards = {}
    for name, param in params.items():
        start, end = shard_rows(param.shape[0], rank, world_size) if param.dim() else (0, 0)
        value = state[name].detach()
        shards[name] = (value[start:end] if value.dim() else value).clone()
    return shards


def reshard(model: nn.Module) -> None:
    """Put every FSDP module back in its sharded state.

    The root module keeps its parameters gathered after a forward (FSDP2 expects the backward
    to need them); after a no-grad forward they must be resharded explicitly before the
    parameters are read or written shard by shard.
    """
    for module in fsdp_modules(model):
        module.reshard()


def fsdp_modules(model: nn.Module) -> list[Any]:
    """The modules `fully_shard` was applied to (they carry FSDPModule's methods)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@torch.no_grad()
def copy_into_shards(model: nn.Module, shards: dict[str, torch.Tensor]) -> None:
    """Write `shards` (from read_local_shards) into the model's local parameter shards."""
    reshard(model)
    for name, param in model.named_parameters():
        local = local_tensor(param)
        source = shards[name]
        if local.shape != source.shape:
            raise CheckpointError(
                f"parameter {name}: checkpoint rows have shape {tuple(source.shape)}, this rank's shard "
                f"is {tuple(local.shape)} (does the checkpoint match the model config?)"
            )
        local.copy_(source)
    for name, buf in hf_experts.persistent_buffers(model):  # those `shards` holds (an expert bias)
        if name in shards:
            buf.copy_(shards[name])


@torch.no_grad()
def snapshot_shards(model: nn.Module) -> dict[str, torch.Tensor]:
    """A CPU copy of this rank's parameter shards and of the model's persistent buffers."""
    reshard(model)
    params = {name: local_tensor(p).detach().to("cpu", copy=True) for name, p in model.named_parameters()}
    return {**params, **{n: b.detach().to("cpu", copy=True) for n, b in hf_experts.persistent_buffers(model)}}
