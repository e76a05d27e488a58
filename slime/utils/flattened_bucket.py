"""SGLang's `flattened_bucket` weight payload, the wire format both ends of the CUDA-IPC push
share (the trainer's slime.bridge.ipc writes it, the torch engine reads it).

Payload: base64 of a `ForkingPickler` dump of `{"flattened_tensor": uint8 tensor, "metadata":
[SimpleNamespace(name, shape, dtype, start_idx, end_idx, numel)]}` with byte offsets (SGLang's
FlattenedTensorBucket layout since 0.5.6, each tensor starting 16-byte aligned; SGLang's
unpickler accepts `types.SimpleNamespace` metadata). A CUDA buffer travels by IPC handle, a CPU
buffer by the name of the shared-memory file it lives in. The engine side unpickles only what a
payload may hold (torch's rebuild functions, dtypes, sizes, metadata).
"""

from __future__ import annotations

import base64
import io
import pickle
import types
from typing import Any

import torch

LOAD_FORMAT = "flattened_bucket"


ALIGN = 16  # bytes: every tensor starts aligned, so its bytes view back as its dtype


def flat_size(bucket: list[tuple[str, torch.Tensor]]) -> int:
    end = 0
    for _, t in bucket:
        end = -(-end // ALIGN) * ALIGN + t.numel() * t.element_size()
    return end


def flatten(
    bucket: list[tuple[str, torch.Tensor]], out: torch.Tensor | None = None
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
        metadata.append(
            types.SimpleNamespace(
                name=name,
                shape=tensor.shape,
                dtype=tensor.dtype,
                start_idx=start,
                end_idx=end,
                numel=end - start,
            )
        )
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
                "handles): install sglang in the trainer's environment, or use --update-weight-transport "
                "distributed"
            ) from e
    monkey_patch_torch_reductions()


# What a payload may contain (engine side): torch's rebuild functions, dtypes, sizes, metadata.
_ALLOWED = {
    ("torch.multiprocessing.reductions", n)
    for n in (
        "rebuild_tensor",
        "rebuild_cuda_tensor",
        "rebuild_storage_fd",
        "rebuild_storage_filename",
        "rebuild_typed_storage",
        "rebuild_typed_storage_child",
        "rebuild_storage_empty",
        "rebuild_event",
    )
} | {
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch", "Tensor"),
    ("torch", "Size"),
    ("torch", "uint8"),
    ("types", "SimpleNamespace"),
    ("torch.storage", "UntypedStorage"),
    ("torch", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("builtins", "slice"),
    ("collections", "OrderedDict"),
    ("slime.utils.flattened_bucket", "open_shared"),
}


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
