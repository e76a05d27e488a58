"""Host <-> device copies that keep the host ahead of the device, in one place so that a step's
transfers can be counted (the engine's decode steps, the trainer's micro-batch loops).

On CUDA a plain `torch.tensor(values, device="cuda")` or `t.to("cuda")` copies from pageable
memory and waits for the GPU's queue to drain: a step that builds a few small input tensors that
way stalls the GPU several times. Inputs go up from pinned memory without waiting (`to_device`;
torch's caching host allocator keeps the pinned copy until the transfer is done, so the caller
may drop or change its tensor at once); results come down once a step (`to_host`, a
synchronising copy; `to_host_async` when the host has other work to do before it needs them).
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`; asynchronous on CUDA (pinned staging), a no-op on CPU."""
    if torch.device(device).type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU (waits for the work that produces it)."""
    return tensor.cpu()


class HostCopy:
    """A device tensor on its way to pinned host memory; `wait()` gives it once it has arrived."""

    def __init__(self, tensor: torch.Tensor):
        self._event: torch.cuda.Event | None = None
        if tensor.device.type == "cpu":
            self._host = tensor
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record()

    def wait(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host


def to_host_async(tensor: torch.Tensor) -> HostCopy:
    """Start copying `tensor` to the host (the step's one copy down, without waiting for it)."""
    return HostCopy(tensor)


class RowsToHost:
    """Results of a loop over micro-batches, one row per sample on the device, brought down in one
    copy when the loop is done (`collect`): copying each micro-batch's down would make the host
    wait for the device at every one, and launch the next only once the device sat idle."""

    def __init__(self, dtype: torch.dtype | None = None):
        """`dtype`: the rows' dtype on the host (None: as they are)."""
        self.dtype = dtype
        self._parts: list[tuple[torch.Tensor, list[int], list[int]]] = []

    def add(self, rows: torch.Tensor, keys: list[int], lengths: list[int]) -> None:
        """`rows` [len(keys), width] on the device: row i is keys[i]'s, its first lengths[i] values."""
        self._parts.append((rows if self.dtype is None else rows.to(self.dtype), keys, lengths))

    def collect(self) -> dict[int, torch.Tensor]:
        """Each key's values on the host (one copy down; waits for the device once)."""
        if not self._parts:
            return {}
        flat = to_host(torch.cat([rows.reshape(-1) for rows, _, _ in self._parts]))
        out: dict[int, torch.Tensor] = {}
        offset = 0
        for rows, keys, lengths in self._parts:
            block = flat[offset : offset + rows.numel()].view(rows.shape)
            offset += rows.numel()
            for row, (key, n) in enumerate(zip(keys, lengths)):
                out[key] = block[row, :n].clone()
        self._parts.clear()
        return out
