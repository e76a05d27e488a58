"""--bf16's float32 master weights: the optimizer steps these, the model computes in bfloat16.
And writing a state into the model (its parameters, their masters, its persistent buffers).

Each micro-batch's bfloat16 gradient is added to its master's float32 gradient as soon as
autograd produced it (accumulation and reductions in float32, as Megatron-LM's
accumulate_allreduce_grads_in_fp32), and the parameter keeps none; after the optimizer step the
masters are copied back into the parameters, rounded to bfloat16.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

State = dict[str, torch.Tensor]


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
        """The gradient the optimizer steps with: the master's, or the parameter's own (a frozen
        parameter, such as MTP modules kept as loaded, has no master and no gradient)."""
        return self[p].grad if p in self else p.grad

    def ensure_grad(self, p: torch.Tensor) -> torch.Tensor:
        """grad_of, made zeros where there is none (the MTP stage's copy of the embedding)."""
        holder = self.get(p, p)
        if holder.grad is None:
            holder.grad = torch.zeros_like(holder)
        return holder.grad

    def move(self, device: str | torch.device) -> None:
        """The masters and their gradients (the last step's, kept until the next zero_grad),
        asynchronously (pinned host memory, as slime.backends.optim.move_model): the caller
        synchronises."""
        for master in self.values():
            master.data = master.data.to(device, non_blocking=True)
            if master.grad is not None:
                master.grad = master.grad.to(device, non_blocking=True)

    def nbytes(self) -> int:
        return sum(m.numel() * m.element_size() for m in self.values())


def persistent_buffers(model: torch.nn.Module) -> State:
    """The model's persistent buffers (in its state dict beside the parameters: the routers'
    expert bias), by their state-dict names."""
    params = {n for n, _ in model.named_parameters()}
    state = model.state_dict(keep_vars=True)
    return {n: t for n, t in state.items() if n not in params and not n.endswith("._extra_state")}


@torch.no_grad()
def copy_in(model: torch.nn.Module, masters: MasterWeights | None, state: State) -> None:
    """Write `state` into the model's parameters (and into `masters`, the float32 master weights
    of --bf16, from the state's own precision) and into the persistent buffers it holds (a
    checkpoint's, a teacher's expert bias). Every parameter must be in `state`, nothing else."""
    from slime.backends.megatron.convert import ConversionError

    params = dict(model.named_parameters())
    buffers = persistent_buffers(model)
    for name, param in params.items():
        if name not in state:
            raise ConversionError(f"parameter {name}: not in the converted checkpoint")
        if tuple(state[name].shape) != tuple(param.shape):
            raise ConversionError(
                f"parameter {name}: checkpoint shard {tuple(state[name].shape)}, model {tuple(param.shape)}"
            )
        param.copy_(state[name])
        if masters is not None and param in masters:
            masters[param].copy_(state[name])
    for name in buffers.keys() & state.keys():
        if tuple(state[name].shape) != tuple(buffers[name].shape):
            raise ConversionError(
                f"buffer {name}: checkpoint shard {tuple(state[name].shape)}, model "
                f"{tuple(buffers[name].shape)}"
            )
        buffers[name].copy_(state[name])
    extra = sorted(set(state) - set(params) - set(buffers))
    if extra:
        raise ConversionError(f"the converted checkpoint has tensors the model lacks: {extra[:5]}")


@torch.no_grad()
def snapshot(model: torch.nn.Module) -> State:
    """A CPU copy of the model's parameters and persistent buffers (copy_in writes it back)."""
    tensors = {**dict(model.named_parameters()), **persistent_buffers(model)}
    return {n: t.detach().to("cpu", copy=True) for n, t in tensors.items()}
