"""The engine's host <-> device copies, in one place so a step's transfers can be counted.

On CUDA a plain `torch.tensor(values, device="cuda")` copies from pageable memory and waits for
the GPU's queue to drain: a step that builds a few small input tensors that way stalls the GPU
several times. Inputs go up from pinned memory without waiting (`to_device`); a step brings its
results down once (`to_host`, the one synchronising copy of a decode step).
"""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`; asynchronous on CUDA (pinned staging), a no-op on CPU."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU (waits for the work that produces it)."""
    return tensor.cpu()
