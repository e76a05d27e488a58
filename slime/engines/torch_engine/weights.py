"""Weight updates and memory release for the torch engine.

Every update is all-or-nothing: the names, dtypes and shapes of the whole request are checked
against the model before the first parameter is written, and the new values are fully received
before any copy starts. A refused update leaves every parameter as it was and names the first
offending tensors. Names are Hugging Face checkpoint names; for tied embeddings both
`model.embed_tokens.weight` and `lm_head.weight` are accepted. Mixture-of-experts models whose
module fuses its experts (slime.utils.hf_experts) are written and reported one expert tensor at
a time, under the checkpoint's per-expert names; the fused module names are accepted too.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from slime.engines.protocol import NamedTensorSpec, ProtocolError
from slime.utils import distributed as sdist
from slime.utils import hf_experts
from slime.utils.shm_tensors import MappedFiles, dtype_from_str, open_named_tensors, parse_handle

logger = logging.getLogger(__name__)


class WeightStore:
    """Owns the engine model's parameters: validation, updates, release and resume."""

    def __init__(self, model: Any):
        self.model = model
        # The checkpoint's tensors: parameters and the buffers it stores (an expert-score bias).
        buffers = list(hf_experts.persistent_buffers(model))
        self.params: dict[str, torch.Tensor] = {
            **dict(model.named_parameters(remove_duplicate=False)),
            **dict(buffers),
        }
        tensors = [*model.named_parameters(), *buffers]  # aliases (tied weights) once
        self._canonical: dict[int, str] = {id(p): name for name, p in tensors}
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        shapes = {name: tuple(p.shape) for name, p in tensors}
        self.slices = hf_experts.checkpoint_slices(model_type, shapes)
        # The tensors this store reports (fingerprints, dumps, checks): checkpoint name ->
        # (canonical parameter, slice of it or None).
        self._entries: dict[str, tuple[str, hf_experts.ExpertSlice | None]] = {}
        fused = hf_experts.by_fused(self.slices)
        for name in shapes:
            for part, where in fused.get(name, [(name, None)]):
                self._entries[part] = (name, where)
        # Every name an update may write -> the entries it writes.
        self._covers: dict[str, list[str]] = {n: [n] for n in self.slices}
        for name, p in self.params.items():
            canonical = self._canonical[id(p)]
            self._covers[name] = [part for part, _ in fused.get(canonical, [(canonical, None)])]
        self._released: dict[str, tuple[torch.Size, torch.dtype, torch.device]] = {}
        # Entries reallocated by resume and not yet written by an update.
        self.stale: set[str] = set()
        self.groups: dict[str, Any] = {}
        self._mapped = MappedFiles()  # the trainer's shared-memory files, mapped once
        self._snapshot: dict[str, torch.Tensor] | None = None  # weights_checker "snapshot"
        # Entry -> the dtype its last update arrived in, for "compare": a trainer holding bfloat16
        # parameters (Megatron --bf16) sends bfloat16 into this float32 engine.
        self._arrived: dict[str, torch.dtype] = {}
        self.applied_fingerprints: dict[str, dict[str, Any]] | None = None

    # ---- validation -------------------------------------------------------------------------
    def validate(self, specs: Iterable[NamedTensorSpec]) -> None:
        """Raise ProtocolError naming every unknown name, non-float dtype or wrong shape."""
        problems = []
        for spec in specs:
            if spec.name not in self._covers:
                problems.append(f"unknown parameter name '{spec.name}'")
                continue
            try:
                dtype = dtype_from_str(spec.dtype)
            except ValueError as e:
                problems.append(f"'{spec.name}': {e}")
                continue
            if not dtype.is_floating_point:
                problems.append(f"'{spec.name}': dtype {spec.dtype} is not a floating-point type")
            expected = tuple(self._shape_of(spec.name))
            if tuple(spec.shape) != expected:
                problems.append(f"'{spec.name}': shape {list(spec.shape)} != expected {list(expected)}")
        if problems:
            more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
            raise ProtocolError(
                "weight update refused, no parameter changed: " + "; ".join(problems[:5]) + more
            )

    def _shape_of(self, name: str) -> tuple[int, ...]:
        where = self.slices.get(name)
        canonical = where.fused if where else self._canonical[id(self.params[name])]
        shape = self._released[canonical][0] if canonical in self._released else self.params[canonical].shape
        return where.shape(shape) if where else tuple(shape)

    def _tensor(self, entry: str) -> torch.Tensor:
        """The tensor an entry names: a parameter, or a view of one expert of a fused one."""
        canonical, where = self._entries[entry]
        param = self.params[canonical]
        return where.view(param) if where else param

    def _target(self, name: str) -> torch.Tensor:
        where = self.slices.get(name)
        return where.view(self.params[where.fused]) if where else self.params[name]

    def specs_of(self, named: list[tuple[str, torch.Tensor]]) -> list[NamedTensorSpec]:
        return [NamedTensorSpec(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named]

    # ---- apply ------------------------------------------------------------------------------
    @torch.no_grad()
    def _apply(self, named: list[tuple[str, torch.Tensor]]) -> int:
        """Copy every tensor in. With `fingerprint_updates` set (a request's `slime_fingerprints`),
        each parameter is fingerprinted right after its copy, while it is still in cache, into
        `applied_fingerprints` (slime.bridge.verify)."""
        from slime.utils.checksum import fingerprint_entry

        if self._released:
            raise ProtocolError("weights are released; call /resume_memory_occupation before updating", 409)
        for name, tensor in named:
            self._target(name).copy_(tensor)
            for entry in self._covers[name]:
                self.stale.discard(entry)
                self._arrived[entry] = tensor.dtype
                if self.applied_fingerprints is not None:
                    self.applied_fingerprints[entry] = fingerprint_entry(self._tensor(entry))
        return len(named)

    def canonical_names(self) -> list[str]:
        return sorted(self._entries)

    def update_from_named(self, named: list[tuple[str, torch.Tensor]]) -> int:
        self.validate(self.specs_of(named))
        return self._apply(named)

    def update_from_disk(self, model_path: Any) -> int:
        """Load every tensor of the safetensors files in `model_path` (validated first)."""
        from safetensors import safe_open

        if not isinstance(model_path, str) or not os.path.isdir(model_path):
            raise ProtocolError(f"'model_path' {model_path!r} is not a directory")
        files = sorted(f for f in os.listdir(model_path) if f.endswith(".safetensors"))
        if not files:
            raise ProtocolError(f"'model_path' {model_path!r} holds no .safetensors files")
        specs, handles = [], []
        try:
            for fname in files:
                f = safe_open(os.path.join(model_path, fname), "pt", device="cpu")
                handles.append(f)
                for key in f.keys():
                    sl = f.get_slice(key)
                    specs.append(
                        NamedTensorSpec(key, _safetensors_dtype(sl.get_dtype()), tuple(sl.get_shape()))
                    )
        except Exception as e:  # corrupt or truncated file
            raise ProtocolError(f"cannot read safetensors in {model_path!r}: {e}") from None
        self.validate(specs)
        named = [(k, f.get_tensor(k)) for f in handles for k in f.keys()]
        return self._apply(named)

    def update_from_tensor(self, serialized: Any, load_format: Any = None) -> int:
        """`serialized_named_tensors`, one entry per TP rank (TP=1 here): a shared-memory handle
        (JSON string; slime.utils.shm_tensors), or with `load_format` "flattened_bucket" an
        SGLang-style flattened bucket shared by handle (slime.utils.flattened_bucket)."""
        return self.update_from_named(self.open_tensors(serialized, load_format))

    def open_tensors(self, serialized: Any, load_format: Any = None) -> list[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs behind `serialized_named_tensors` (see update_from_tensor);
        the tensors may live in the sender's shared memory: copy what must outlive the call."""
        if not isinstance(serialized, list) or len(serialized) != 1 or not isinstance(serialized[0], str):
            raise ProtocolError(
                "'serialized_named_tensors' must be a list with one handle string "
                "(this engine has tensor-parallel size 1)"
            )
        if load_format not in (None, "flattened_bucket"):
            raise ProtocolError(f"'load_format' {load_format!r} is not supported: null or 'flattened_bucket'")
        try:
            if load_format == "flattened_bucket":
                from slime.utils.flattened_bucket import deserialize

                named = deserialize(serialized[0])
            else:
                named = open_named_tensors(parse_handle(serialized[0]), self._mapped)
        except (ValueError, TypeError, OverflowError, RuntimeError, OSError) as e:
            # Everything here comes from the client's handle (path, sizes, shapes, offsets).
            raise ProtocolError(f"cannot open 'serialized_named_tensors': {e}") from None
        return list(named)

    # ---- distributed ------------------------------------------------------------------------
    def init_group(self, body: dict[str, Any], device: torch.device) -> None:
        address, port, rank_offset, world_size, group_name, backend, timeout = _group_settings(body, device)
        logger.info(
            "joining weight-update group %r at %s:%d as rank %d/%d (%s)",
            group_name,
            address,
            port,
            rank_offset,
            world_size,
            backend,
        )
        if group_name in self.groups:
            logger.warning("replacing weight-update group %r: the old one is shut down", group_name)
            self._drop_group(group_name)
        try:
            self.groups[group_name] = sdist.new_group(
                backend, address, port, rank_offset, world_size, timeout
            )
        except Exception as e:
            raise ProtocolError(f"could not join weight-update group {group_name!r}: {e}", 500) from None

    def destroy_group(self, group_name: str) -> None:
        if group_name not in self.groups:
            raise ProtocolError(f"no weight-update group named {group_name!r}")
        self._drop_group(group_name)

    def _drop_group(self, group_name: str, abort: bool = False) -> None:
        """Forget the group and shut it down; a failure to shut down is only logged."""
        group = self.groups.pop(group_name)
        try:
            sdist.destroy_group(group, abort=abort)
        except Exception:
            logger.exception("shutting down weight-update group %r failed", group_name)

    def update_from_distributed(
        self, specs: list[NamedTensorSpec], group_name: str, device: torch.device
    ) -> int:
        """Receive every tensor by broadcast from rank 0, then copy them all.

        The broadcasts are received even when validation fails, so the trainer never blocks on
        a peer that walked away; the update is then refused as a whole.
        """
        group = self.groups.get(group_name)
        if group is None:
            raise ProtocolError(
                f"no weight-update group named {group_name!r}; call /init_weights_update_group first"
            )
        try:
            dtypes = [dtype_from_str(s.dtype) for s in specs]
        except ValueError as e:
            # We cannot size the receive buffers, so the group can no longer be trusted.
            self._drop_group(group_name, abort=True)
            raise ProtocolError(f"{e}; group {group_name!r} was destroyed, re-initialise it") from None
        problem = None
        try:
            self.validate(specs)
        except ProtocolError as e:
            problem = e
        received = []
        for spec, dtype in zip(specs, dtypes):
            try:
                buf = torch.empty(spec.shape, dtype=dtype, device=device)
                sdist.broadcast(group, buf, root=0)
            except Exception as e:
                # The trainer and this engine no longer agree on which broadcast comes next:
                # the group is useless. Destroy it so the next init starts from a clean slate.
                self._drop_group(group_name, abort=True)
                raise ProtocolError(
                    f"receiving '{spec.name}' over weight-update group {group_name!r} failed: {e}; "
                    "no parameter changed; the group was destroyed, re-initialise it with "
                    "/init_weights_update_group",
                    500,
                ) from None
            received.append((spec.name, buf))
        if problem is not None:
            raise problem
        return self._apply(received)

    def checksums(self, names: list[str] | None = None) -> dict[str, str]:
        """Fingerprints (slime.utils.checksum) of the named parameters (all canonical ones by default)."""
        from slime.utils.checksum import tensor_checksum

        wanted = names if names is not None else self.canonical_names()
        unknown = [n for n in wanted if n not in self._entries]
        if unknown:
            raise ProtocolError(f"unknown parameter names {unknown[:5]}")
        released = [n for n in wanted if self._entries[n][0] in self._released or n in self.stale]
        if released:
            raise ProtocolError(f"parameters {released[:5]} are released or not reloaded yet")
        return {n: tensor_checksum(self._tensor(n)) for n in wanted}

    # ---- verification (issue 7: docs/debugging.md "Parameter sync") -------------------------
    def _canonical_params(self) -> list[tuple[str, torch.Tensor]]:
        if self._released or self.stale:
            raise ProtocolError(
                "parameters are released or not reloaded yet; resume and update them first", 409
            )
        return [(name, self._tensor(name)) for name in sorted(self._entries)]

    def fingerprints(self) -> dict[str, dict[str, Any]]:
        """Every parameter (canonical names): dtype, shape and slime.utils.checksum's fingerprint."""
        from slime.utils.checksum import fingerprint_entry

        return {name: fingerprint_entry(p) for name, p in self._canonical_params()}

    def dump(self, dir_fd: int, extra: Sequence[tuple[str, torch.Tensor]] = ()) -> int:
        """torch.save every parameter to <HF name> in the open directory `dir_fd` (and the `extra`
        tensors: the served LoRA adapters'), written under a temporary name first. O_NOFOLLOW: a
        symlink at that name fails the write instead of redirecting it, and the rename replaces a
        symlink at the final name, never its target."""
        params = [*self._canonical_params(), *extra]
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
        for name, p in params:
            fd = os.open(name + ".partial", flags, 0o644, dir_fd=dir_fd)
            with os.fdopen(fd, "wb") as f:
                torch.save(p.detach().to("cpu", copy=True), f)
            os.replace(name + ".partial", name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return len(params)

    def snapshot(self) -> int:
        """SGLang's weights_checker "snapshot": a CPU copy of every parameter."""
        self._snapshot = {name: p.detach().to("cpu", copy=True) for name, p in self._canonical_params()}
        self._arrived.clear()
        return len(self._snapshot)

    @torch.no_grad()
    def reset_tensors(self) -> int:
        """ "reset_tensors": overwrite every parameter with uniform [0, 1) noise, so that one the
        next push does not write is seen by "compare"."""
        generator = torch.Generator(device="cpu").manual_seed(0)
        params = self._canonical_params()
        for _, p in params:
            p.copy_(torch.rand(p.shape, generator=generator, dtype=torch.float32).to(p.dtype))
        return len(params)

    def compare(self) -> tuple[list[str], str]:
        """ "compare": one line per parameter that differs from the snapshot, and a note on how
        they were compared. Exact comparison, except that a parameter whose update since the
        snapshot arrived in a narrower dtype than this engine holds (a bfloat16 trainer, a
        float32 engine) is compared with the snapshot rounded to that dtype first: the rounding
        is the trainer's precision, not a sync error, and noise left by a missing update still
        differs."""
        snapshot = self._snapshot
        if snapshot is None:
            raise ProtocolError("weights_checker compare: no snapshot; send action 'snapshot' first")
        problems, rounded = [], Counter[str]()
        for name, p in self._canonical_params():
            expected, actual = snapshot[name], p.detach().to("cpu")
            sent = self._arrived.get(name, actual.dtype)
            through = ""
            if sent.is_floating_point and torch.finfo(sent).bits < torch.finfo(actual.dtype).bits:
                expected = expected.to(sent).to(actual.dtype)
                through = f" (snapshot rounded to {_dtype_name(sent)}, the dtype the update arrived in)"
                rounded[_dtype_name(sent)] += 1
            if expected.shape != actual.shape or expected.dtype != actual.dtype:
                problems.append(
                    f"name={name} shape/dtype {tuple(actual.shape)} {actual.dtype} != "
                    f"{tuple(expected.shape)} {expected.dtype}"
                )
            elif not torch.equal(expected, actual):
                err = (expected.double() - actual.double()).abs()
                problems.append(
                    f"name={name} max_abs_err={err.max().item():.6g} mean_abs_err={err.mean().item():.6g} "
                    f"first_index={int((err != 0).view(-1).nonzero()[0])}{through}"
                )
        note = "; ".join(
            f"{n} compared with the snapshot rounded to {dtype}, the dtype their update arrived in"
            for dtype, n in sorted(rounded.items())
        )
        return problems, note

    # ---- memory -----------------------------------------------------------------------------
    def release(self) -> None:
        """Free every parameter's memory, keeping the shapes for resume."""
        for name, p in self.model.named_parameters():
            if name not in self._released:
                self._released[name] = (p.shape, p.dtype, p.device)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def resume(self) -> None:
        """Reallocate released parameters (uninitialised until an update writes them)."""
        params = dict(self.model.named_parameters())
        for name, (shape, dtype, device) in self._released.items():
            params[name].data = torch.empty(shape, dtype=dtype, device=device)
            self.stale.update(self._covers[name])
        self._released.clear()

    @property
    def released(self) -> bool:
        return bool(self._released)

    def describe_stale(self) -> str:
        names = sorted(self.stale)
        return f"{len(names)} parameter(s) not reloaded since resume_memory_occupation, e.g. {names[:3]}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _safetensors_dtype(code: str) -> str:
    from slime.utils.weight_delta import SAFETENSORS_DTYPES

    return SAFETENSORS_DTYPES.get(code, code.lower())


def _group_settings(body: dict[str, Any], device: torch.device) -> tuple[str, int, int, int, str, str, float]:
    """The fields of /init_weights_update_group, each checked for type and range before any
    rendezvous is attempted (a hostile value must not make the engine dial out or wait)."""

    def integer(name: str, low: int, high: int) -> int:
        value = body.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise ProtocolError(
                f"init_weights_update_group: '{name}' must be an integer in [{low}, {high}], got {value!r}"[
                    :300
                ]
            )
        return value

    address = body.get("master_address")
    if not isinstance(address, str) or not address or len(address) > 255:
        raise ProtocolError("init_weights_update_group: 'master_address' must be a host name or address")
    port = integer("master_port", 1, 65535)
    world_size = integer("world_size", 2, 1 << 20)
    rank_offset = integer("rank_offset", 1, world_size - 1)  # rank 0 is the trainer
    group_name = body.get("group_name") or "weight_update_group"
    if not isinstance(group_name, str):
        raise ProtocolError("init_weights_update_group: 'group_name' must be a string")
    backend = body.get("backend") or ("nccl" if device.type == "cuda" else "gloo")
    if backend not in ("gloo", "nccl"):
        raise ProtocolError(f"'backend' must be 'gloo' or 'nccl', got {backend!r}"[:300])
    timeout = body.get("timeout_s") or 300
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout <= 86400:
        raise ProtocolError(
            "init_weights_update_group: 'timeout_s' must be a number of seconds in (0, 86400]"
        )
    return address, port, rank_offset, world_size, group_name, backend, float(timeout)
