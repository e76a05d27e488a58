"""The optimizer (AdamW or SGD) and the learning-rate schedule shared by the train backends."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from slime.config.train import OptimizerConfig
from slime.utils.device_memory import release_device_memory

SCHEDULE_RULE = 2
"""The schedule `lr_at` computes, saved with every checkpoint: 2 is Megatron-LM's (1 warmed up from
lr / W and counted the decay after warm-up)."""


def lr_at(cfg: OptimizerConfig, step: int) -> float:
    """Learning rate of optimizer step `step` (0-based), Megatron-LM's schedule (so slime's), with
    W = --lr-warmup-iters and D = --lr-decay-iters:

    - step <= W (W > 0): warm-up, init + (lr - init) * step / W (the first step runs at
      --lr-warmup-init, 0 by default);
    - constant: lr;
    - step > D: min_lr;
    - otherwise, with progress = (step - W) / (D - W): linear lr + (min_lr - lr) * progress, or
      cosine min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2.
    """
    warmup = cfg.lr_warmup_iters
    if warmup > 0 and step <= warmup:
        return cfg.lr_warmup_init + (cfg.lr - cfg.lr_warmup_init) * step / warmup
    if cfg.lr_decay_style == "constant":
        return cfg.lr
    assert cfg.lr_decay_iters and cfg.lr_decay_iters > warmup
    if step > cfg.lr_decay_iters:
        return cfg.min_lr
    progress = (step - warmup) / (cfg.lr_decay_iters - warmup)
    if cfg.lr_decay_style == "linear":
        return cfg.lr + (cfg.min_lr - cfg.lr) * progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


class LRSchedule:
    """Sets the optimizer's lr from `lr_at` before each step; its state is the step count."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimizerConfig):
        self.optimizer = optimizer
        self.cfg = cfg
        self.num_steps = 0
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.cfg, self.num_steps)

    @property
    def lr(self) -> float:
        return lr_at(self.cfg, self.num_steps)

    def step(self) -> None:
        self.num_steps += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "config": _config_dict(self.cfg), "rule": SCHEDULE_RULE}

    def load_state_dict(self, state: dict, override: bool) -> None:
        """Restore the step count; refuse a changed schedule unless `override`."""
        saved = state.get("config", {})
        current = _config_dict(self.cfg)
        if saved.get("optimizer", current["optimizer"]) != current["optimizer"]:
            raise ValueError(
                f"the checkpoint's optimizer is {saved['optimizer']}, --optimizer is "
                f"{current['optimizer']}: its states cannot be carried over; resume with --optimizer "
                + saved["optimizer"]
            )
        if state.get("rule", 1) != SCHEDULE_RULE and not override:
            raise ValueError(
                "the checkpoint was written with the previous learning-rate schedule (warm-up from lr / "
                "W, decay counted after warm-up); this version follows Megatron-LM's: pass "
                "--override-opt-param-scheduler to resume with it"
            )
        changed = {k: (saved[k], current[k]) for k in current if k in saved and saved[k] != current[k]}
        if changed and not override:
            detail = ", ".join(f"{k}: saved {a} vs now {b}" for k, (a, b) in sorted(changed.items()))
            raise ValueError(
                f"the checkpoint was trained with different optimizer settings ({detail}); "
                "pass --override-opt-param-scheduler to resume with the new values"
            )
        self.num_steps = int(state["num_steps"])
        self._apply()


def _config_dict(cfg: OptimizerConfig) -> dict:
    keys = (
        "lr",
        "min_lr",
        "lr_decay_style",
        "lr_warmup_iters",
        "lr_warmup_init",
        "lr_decay_iters",
        "weight_decay",
        "optimizer",
        "sgd_momentum",
        "adam_beta1",
        "adam_beta2",
        "adam_eps",
    )
    return {k: getattr(cfg, k) for k in keys}


class StatelessAdamW(torch.optim.AdamW):
    """--use-stateless-adam: AdamW whose states are dropped after every step, so each step is a
    fresh AdamW's first: bias-corrected moments g and g^2, the update -lr * g / (|g| + eps) after
    the decoupled weight decay (slime's StatelessAdam with bias correction, its default). Built on
    torch's AdamW rather than written out, so its kernels (foreach, fused) stay torch's."""

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        out = super().step(closure)
        self.state.clear()
        return out


def reset_states(optimizer: torch.optim.Optimizer) -> None:
    """--reset-optimizer-states: every state dropped (Adam's moments and step counts, SGD's
    momentum); the next step starts them afresh, as zeros (slime zeroes them in place)."""
    optimizer.state.clear()


def freeze_parameters(model: torch.nn.Module, cfg: OptimizerConfig, strict: bool = True) -> int:
    """--only-train-params-name-list / --freeze-params-name-list on `model`'s parameter names
    (re.search, as slime); the number of parameters frozen here. With `strict` (the actor; a
    critic has other names), a pattern that matches no parameter on any rank is an error: a typo
    would otherwise train everything. Collective over the default group when `strict`."""
    import re

    import torch.distributed as dist

    only, frozen = cfg.only_train_params_name_list, cfg.freeze_params_name_list
    patterns = only if only is not None else frozen
    if patterns is None:
        return 0
    names = [name for name, _ in model.named_parameters()]
    hits = [sum(bool(re.search(p, n)) for n in names) for p in patterns]
    if strict and dist.is_initialized():
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, hits)
        hits = [sum(h) for h in zip(*everyone)]
    flag = "--only-train-params-name-list" if only is not None else "--freeze-params-name-list"
    unmatched = [p for p, h in zip(patterns, hits) if not h and strict]
    if unmatched:
        raise ValueError(
            f"{flag}: {', '.join(map(repr, unmatched))} matches no parameter of the model; its names look "
            f"like {', '.join(names[:3])}"
        )
    count = 0
    for name, param in model.named_parameters():
        matched = any(re.search(p, name) for p in patterns)
        if matched != (only is not None) and param.requires_grad:
            param.requires_grad_(False)
            count += 1
    return count


def make_optimizer(params: Iterable[torch.Tensor], cfg: OptimizerConfig) -> torch.optim.Optimizer:
    """--optimizer adam: AdamW (Megatron-LM's adam decouples the weight decay too), one fused
    kernel per step where every parameter is on a GPU (torch's `fused=True`, DTensor shards
    included; the CPU keeps torch's default, so CPU runs compute as before); sgd: SGD with
    --sgd-momentum."""
    params = list(params)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.sgd_momentum, weight_decay=cfg.weight_decay)
    adam = StatelessAdamW if cfg.use_stateless_adam else torch.optim.AdamW
    on_gpu = adam is torch.optim.AdamW and params and all(p.device.type == "cuda" for p in params)
    return adam(
        params,
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        **({"fused": True} if on_gpu else {}),
    )


def state_bytes(
    optimizer: torch.optim.Optimizer, local: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
) -> int:
    """Bytes of the optimizer's state tensors on this rank (`local`: a sharded tensor's own shard)."""
    return sum(
        local(value).numel() * value.element_size()
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    )


def move_state(optimizer: torch.optim.Optimizer, device: str | torch.device) -> None:
    """Every optimizer state tensor to `device`. A function of its own so that no local of the
    caller still holds a device tensor when the caller releases device memory (a loop variable
    did: the H200 run found the last state tensor freed only after the release, leaving a 2 MiB
    segment reserved)."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                state[key] = value.to(device, non_blocking=True)


def move_model(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    device: str | torch.device,
    params: bool = True,
) -> None:
    """Colocation: optimizer states, and parameters with `params`, to `device`; on the way to the
    host every unused byte of device memory goes back to the driver (a colocated engine needs
    every byte, cuBLAS's workspaces too).

    On the way to the host the last step's gradients are dropped, not moved (every train step
    starts from none), and the copies are asynchronous: torch puts a non-blocking copy from the
    device into pinned host memory, from its caching host allocator, so later offloads reuse those
    blocks, and the copy back up is asynchronous too. Pageable copies made Qwen3-0.6B's offload
    take 4.4 s on an H200 (about 2 GB/s). Both ways end in one synchronisation, before anything
    reads the copies."""
    to_host = torch.device(device).type == "cpu"
    if to_host:
        model.zero_grad(set_to_none=True)
    if params:
        model.to(device, non_blocking=True)
    move_state(optimizer, device)
    if to_host:
        release_device_memory()
    else:
        torch.cuda.synchronize()
