"""`tensor` transport by handle: each bucket flattened into one byte buffer per train rank and
shared with the engines as SGLang's `load_format="flattened_bucket"` payload.

On GPU (colocated) this is the CUDA-IPC push: engine j's tensor-parallel rank k sits on the GPU of
train rank o_j + k, where o_j = tp_0 + ... + tp_(j-1) sums the TP sizes of the engines before it
(slime.bridge.topology checks the nodes), so every train rank shares its own copy of the bucket
(all-gathered already) and rank 0 sends engine j the payloads of ranks o_j .. o_j+tp_j-1, one per
TP rank, in TP order, as SGLang expects (`serialized_named_tensors[tp_rank]`). On CPU the same
code shares the buffer through a shared-memory file (torch's `file_system` strategy), which lets
the torch engine and the tests run this path for real; only the CUDA handle itself needs a GPU.

Payload: base64 of a `ForkingPickler` dump of `{"flattened_tensor": uint8 tensor, "metadata":
[SimpleNamespace(name, shape, dtype, start_idx, end_idx, numel)]}` with byte offsets (SGLang's
FlattenedTensorBucket layout since 0.5.6, each tensor starting 16-byte aligned; SGLang's
unpickler accepts `types.SimpleNamespace` metadata). For SGLang engines the trainer applies SGLang's own `monkey_patch_torch_reductions`
(imported lazily) so CUDA handles carry the device UUID, which SGLang maps to its local index.

A rank's buffer is dropped (GPU) or overwritten by the next bucket (CPU: one shared-memory file
per push) only after every engine answered for the bucket, a barrier that rank 0 reaches once its
requests returned; so one bucket per rank is shared at a time.
"""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import pickle
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from slime.bridge.base import Bucket
from slime.engines.client import EngineClient

LOAD_FORMAT = "flattened_bucket"


ALIGN = 16  # bytes: every tensor starts aligned, so its bytes view back as its dtype


def flat_size(bucket: Bucket) -> int:
    end = 0
    for _, t in bucket:
        end = -(-end // ALIGN) * ALIGN + t.numel() * t.element_size()
    return end


def flatten(
    bucket: Bucket, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[types.SimpleNamespace]]:
    """One uint8 buffer holding every tensor's bytes, each starting at a multiple of ALIGN
    (`out`, or a new buffer on the bucket's device), and each tensor's place in it."""
    total = flat_size(bucket)
    device = bucket[0][1].device if bucket else torch.device("cpu")
    flat = out[:total] if out is not None else torch.empty(total, dtype=torch.uint8, device=device)
    metadata, end = [], 0
    for name, tensor in bucket:
        start = -(-end // ALIGN) * ALIGN
        end = start + tensor.numel() * tensor.element_size()
        flat[start:end].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        metadata.append(types.SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype,
                                              start_idx=start, end_idx=end, numel=end - start))  # fmt: skip
    return flat, metadata


def open_shared(path: str, nbytes: int) -> torch.Tensor:
    """Engine side of a CPU buffer: map the trainer's shared-memory file (no copy)."""
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def serialize(
    flat: torch.Tensor,
    metadata: list[types.SimpleNamespace],
    sglang_reductions: bool,
    shared_path: str | None = None,
) -> str:
    """The payload string for one rank's buffer (shared, not copied): a CUDA tensor by IPC
    handle; a CPU buffer by the name of the shared-memory file it lives in (`shared_path`)."""
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing.reductions  # noqa: F401 - registers torch's reducers

    if flat.is_cuda and sglang_reductions:
        _patch_sglang_reductions()
    if not flat.is_cuda and shared_path is None:
        raise ValueError("a CPU buffer is shared through its shared-memory file: give shared_path")

    class Pickler(ForkingPickler):
        def reducer_override(self, obj: Any) -> Any:
            if obj is flat and not flat.is_cuda:
                return open_shared, (shared_path, flat.numel())
            return NotImplemented

    buf = io.BytesIO()
    Pickler(buf).dump({"flattened_tensor": flat, "metadata": metadata})
    return base64.b64encode(buf.getvalue()).decode()


def _patch_sglang_reductions() -> None:
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:
        try:
            from sglang.srt.patch_torch import monkey_patch_torch_reductions  # SGLang before 0.5
        except ImportError as e:
            raise RuntimeError(
                "the CUDA-IPC push to SGLang engines uses SGLang's torch reductions (device UUIDs in the "
                "handles): install sglang in the trainer's environment, or use --update-weight-transport distributed"
            ) from e
    monkey_patch_torch_reductions()


# What a payload may contain (engine side): torch's rebuild functions, dtypes, sizes, metadata.
_ALLOWED = {
    ("torch.multiprocessing.reductions", n)
    for n in ("rebuild_tensor", "rebuild_cuda_tensor", "rebuild_storage_fd", "rebuild_storage_filename",
              "rebuild_typed_storage", "rebuild_typed_storage_child", "rebuild_storage_empty", "rebuild_event")
} | {("torch._utils", "_rebuild_tensor_v2"), ("torch", "Tensor"), ("torch", "Size"), ("torch", "uint8"), ("types", "SimpleNamespace"),
     ("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage"), ("torch.storage", "TypedStorage"),
     ("builtins", "slice"), ("collections", "OrderedDict"), ("slime.bridge.ipc", "open_shared")}  # fmt: skip


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"a weight payload may not contain {module}.{name}")


def deserialize(payload: str, device: torch.device | None = None) -> list[tuple[str, torch.Tensor]]:
    """Engine side: the named tensors of one payload (views of the shared buffer)."""
    try:
        obj = _Unpickler(io.BytesIO(base64.b64decode(payload, validate=True))).load()
        flat, metadata = obj["flattened_tensor"], obj["metadata"]
    except Exception as e:
        raise ValueError(f"not a {LOAD_FORMAT} payload: {type(e).__name__}: {e}") from None
    if device is not None:
        flat = flat.to(device)
    return [(m.name, flat[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in metadata]


def share_buckets(
    buckets: Iterable[Bucket], transport: IpcTransport | None, sglang_reductions: bool
) -> Iterator[Bucket]:
    """Every train rank: share each bucket's buffer; rank 0 (the one with `transport`) gets all
    ranks' payloads for the bucket it is about to send. Collective: every rank must iterate."""
    import torch.distributed as dist

    from slime.utils.shm_tensors import SharedBuffer

    world = dist.get_world_size() if dist.is_initialized() else 1
    shared: SharedBuffer | None = None  # CPU: one file for the push, reused bucket after bucket
    try:
        for bucket in buckets:
            nbytes = flat_size(bucket)
            if (
                bool(bucket)
                and bucket[0][1].device.type == "cpu"
                and (shared is None or shared.nbytes < nbytes)
            ):
                if shared is not None:
                    shared.close()
                shared = SharedBuffer.create(max(nbytes, 1))
            flat, metadata = flatten(bucket, shared.data if shared is not None else None)
            payload = serialize(
                flat, metadata, sglang_reductions, shared.path if shared is not None else None
            )
            gathered: list[Any] | None = [None] * world if transport is not None else None
            if world > 1:
                dist.gather_object(payload, gathered, dst=0)
            elif gathered is not None:
                gathered[0] = payload
            if transport is not None:
                transport.payloads = [str(p) for p in gathered or []]
            yield bucket  # rank 0: sent and answered by every engine when this resumes
            if world > 1:
                dist.barrier()  # now no engine reads this rank's buffer any more
            del flat
            if shared is None and torch.cuda.is_available():
                torch.cuda.ipc_collect()
    finally:
        if shared is not None:
            shared.close()


def split_by_engine(payloads: list[str], tp_sizes: Sequence[int], what: str) -> list[list[str]]:
    """Every train rank's payload of `what`, in rank order, split into each engine's TP ranks'
    (engine j gets those of ranks o_j .. o_j+tp_j-1)."""
    if len(payloads) < sum(tp_sizes):
        raise RuntimeError(
            f"{len(payloads)} train ranks shared {what}, but {len(tp_sizes)} engines of tensor-parallel sizes "
            f"{list(tp_sizes)} need one per engine GPU (the CUDA-IPC push is for --colocate)"
        )
    starts = itertools.accumulate(tp_sizes, initial=0)
    return [payloads[o : o + tp] for o, tp in zip(starts, tp_sizes)]


class IpcTransport:
    """Rank 0's side: sends engine j the payloads of its TP ranks and waits for every answer."""

    name = "tensor"
    session = True

    def __init__(self, tp_sizes: Sequence[int] | None = None) -> None:
        """`tp_sizes`: each engine's tensor-parallel size, in the bridge's engine order (None: 1 each)."""
        self.tp_sizes = None if tp_sizes is None else tuple(tp_sizes)
        self.payloads: list[str] = []

    async def setup(self, engines: list[EngineClient]) -> None:
        return None

    async def send(self, engines: list[EngineClient], bucket: Bucket, weight_version: str) -> None:
        sizes = self.tp_sizes if self.tp_sizes is not None else (1,) * len(engines)
        if len(sizes) != len(engines):
            raise RuntimeError(f"{len(sizes)} tensor-parallel sizes for {len(engines)} engines")
        per_engine = split_by_engine(self.payloads, sizes, "the bucket")
        self.payloads = []
        await asyncio.gather(*(
            e.update_weights_from_tensor(p, load_format=LOAD_FORMAT, weight_version=weight_version)
            for e, p in zip(engines, per_engine)
        ))  # fmt: skip

    async def finish(self, engines: list[EngineClient], weight_version: str) -> None:
        return None

    async def abort(self) -> None:
        self.payloads = []

    async def close(self, engines: list[EngineClient]) -> None:
        self.payloads = []
