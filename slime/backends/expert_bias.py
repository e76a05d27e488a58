"""Aux-loss-free load balancing (DeepSeek-V3, GLM-4.5+, GLM-4.7-Flash):
`--moe-router-bias-update-rate`.

Such a router picks its experts by score + bias, and the bias moves after each optimizer step:

    bias[e] += rate * sign(mean count - count[e])

where count[e] is how many of the step's tokens the router sent to expert e (megatron-core's rule,
its get_updated_expert_bias): an expert that got fewer tokens than the mean is favoured next step,
one that got more is held back. The counts are summed over every rank that trained on a share of
the step (the backend gives that group) before the update, so every replica moves its bias alike.

Both backends count the same tokens: the real tokens (not padding) of the training forwards (not
the log-prob passes, which run without autograd), each micro-batch once (a forward recomputed in
backward is not counted again). The Megatron actor takes megatron-core's own count (its router's
`local_tokens_per_expert`, given the padding mask); the FSDP actor counts with `TokenCounts`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


def updated_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """One update of [layers, experts] biases from [layers, experts] token counts."""
    counts = counts.to(torch.float32)
    mean = counts.sum(dim=-1, keepdim=True) / counts.shape[-1]
    return bias + torch.sign(mean - counts).to(bias.dtype) * rate


@torch.no_grad()
def update_biases(
    biases: Sequence[torch.Tensor], counts: Sequence[torch.Tensor], rate: float, group: Any = None
) -> None:
    """Sum each layer's counts over `group` (when a process group is up) and update its bias in place."""
    if not biases:
        return
    stacked = torch.stack([c.to(torch.float32) for c in counts]).to(biases[0].device)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(stacked, group=group)
    new = updated_bias(torch.stack([b.detach() for b in biases]), stacked, rate)
    for bias, value in zip(biases, new, strict=True):
        bias.copy_(value)


class TokenCounts:
    """The FSDP actor's count: a forward hook on each router of Hugging Face's DeepSeek-V3 /
    GLM-4.5 modeling (a module whose output is (logits, top-k weights, top-k experts) and whose
    buffer `e_score_correction_bias` is the bias) records, per micro-batch, how many of its real
    tokens went to each expert. The hook assigns rather than adds, so a recomputed forward of the
    same micro-batch (gradient checkpointing) leaves the count as it was."""

    def __init__(self, routers: list[torch.nn.Module]):
        # The routers, not their buffers: moving the model (sleep / wake) replaces buffer objects,
        # so each step reads the bias the model holds then.
        self.routers = routers
        self.experts = routers[0].get_buffer("e_score_correction_bias").numel()
        self.totals: list[torch.Tensor | None] = [None] * len(routers)
        self.current: dict[int, torch.Tensor] = {}
        self.real: torch.Tensor | None = None
        for i, router in enumerate(routers):
            router.register_forward_hook(self._hook(i))  # type: ignore[arg-type]

    @property
    def biases(self) -> list[torch.Tensor]:
        return [r.get_buffer("e_score_correction_bias") for r in self.routers]

    @classmethod
    def find(cls, model: torch.nn.Module) -> TokenCounts | None:
        routers = [
            m
            for m in model.modules()
            if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor)
        ]
        return cls(routers) if routers else None

    def _hook(self, i: int) -> Any:
        def hook(_module: torch.nn.Module, _args: Any, output: Any) -> None:
            if self.real is None or not torch.is_grad_enabled():
                return
            experts = output[2]  # [tokens, top-k]
            # Each real token's k experts counted once, on the device: index_add_ rather than a
            # boolean mask or bincount (CUDA's reads the ids' maximum back), neither waits.
            real = self.real[:, None].expand(experts.shape).reshape(-1)
            counts = torch.zeros(self.experts, dtype=torch.float32, device=experts.device)
            self.current[i] = counts.index_add_(0, experts.reshape(-1), real)

        return hook

    def begin(self, real: torch.Tensor) -> None:
        """A training micro-batch starts; `real`: its [rows * length] real-token mask (flattened as
        the routers see the tokens), on the routers' device."""
        self.real, self.current = real.float(), {}

    def end(self) -> None:
        """The micro-batch's backward is done: its counts join the step's."""
        for i, counts in self.current.items():
            total = self.totals[i]
            self.totals[i] = counts if total is None else total + counts.to(total.device)
        self.real, self.current = None, {}

    def step(self, rate: float, group: Any = None) -> None:
        """After the optimizer step: update every bias from the step's counts, and start again."""
        biases = self.biases
        counts = [
            t if t is not None else torch.zeros(self.experts, device=b.device)
            for t, b in zip(self.totals, biases, strict=True)
        ]
        update_biases(biases, counts, rate, group)
        self.totals = [None] * len(self.routers)
