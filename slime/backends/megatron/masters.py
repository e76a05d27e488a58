"""--bf16's float32 master weights: the optimizer steps these, the model computes in bfloat16.

Each micro-batch's bfloat16 gradient is added to its master's float32 gradient as soon as
autograd produced it (accumulation and reductions in float32, as Megatron-LM's
accumulate_allreduce_grads_in_fp32), and the parameter keeps none; after the optimizer step the
masters are copied back into the parameters, rounded to bfloat16.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class MasterWeights(dict[torch.Tensor, torch.Tensor]):
    """Parameter -> its float32 master (empty without --bf16: the parameters are their own)."""

    @classmethod
    def attach(cls, params: Iterable[torch.Tensor]) -> MasterWeights:
        """Masters for `params`, zero until loaded, each fed by a hook on its parameter."""
        masters = cls({p: torch.zeros_like(p, dtype=torch.float32) for p in params})
        for p in masters:
            p.register_post_accumulate_grad_hook(masters.accumulate)
        return masters

    def accumulate(self, p: torch.Tensor) -> None:
        assert p.grad is not None
        master = self[p]
        if master.grad is None:
            master.grad = p.grad.float()
        else:
            master.grad.add_(p.grad)
        p.grad = None

    @torch.no_grad()
    def copy_back(self) -> None:
        """After the optimizer step: every parameter from its master (rounded to bfloat16)."""
        for p, master in self.items():
            p.copy_(master)
            master.grad = None

    def grad_of(self, p: torch.Tensor) -> torch.Tensor | None:
        """The gradient the optimizer steps with: the master's, or the parameter's own."""
        return self[p].grad if self else p.grad

    def move(self, device: str | torch.device) -> None:
        """The masters and their gradients (the last step's, kept until the next zero_grad)."""
        for master in self.values():
            master.data = master.data.to(device)
            if master.grad is not None:
                master.grad = master.grad.to(device)

    def nbytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.values())
