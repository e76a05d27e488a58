"""What the two train backends' checkpoints share: the `--save DIR` layout (Megatron's, so tools
and habits carry over), the save that becomes visible only when complete, the RNG state, the
optimizer flags applied over a loaded state, and the dtype a Hugging Face export is written in.

    DIR/latest_checkpointed_iteration.txt     rollout id of the newest complete checkpoint
    DIR/iter_0000007/                         one checkpoint (each backend's own files inside)

A checkpoint is written into `iter_XXXXXXX.partial`, created by rank 0 (`start_save`), and
renamed only after every rank finished; the tracker file is replaced atomically after that, so
an interrupted save never becomes the one a resume picks.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from slime.backends.optim import LRSchedule
from slime.config.train import TrainConfig

TRACKER = "latest_checkpointed_iteration.txt"


def iteration_dir(root: str, rollout_id: int) -> str:
    return os.path.join(root, f"iter_{rollout_id:07d}")


def broadcast_error(message: str | None) -> None:
    """Raise the same error on every rank if rank 0 found one (keeps ranks in step)."""
    box = [message]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise RuntimeError(box[0])


def start_save(root: str, rollout_id: int, rank: int) -> tuple[str, str]:
    """(iteration dir, its `.partial` twin), the twin created empty by rank 0; an error there
    raises on every rank (collective)."""
    final = iteration_dir(root, rollout_id)
    partial = final + ".partial"
    error = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)
            os.makedirs(partial)
        except OSError as e:
            error = f"--save {root!r}: cannot create {partial!r} ({e})"
    broadcast_error(error)
    return final, partial


def latest_rollout_id(root: str) -> int | None:
    tracker = os.path.join(root, TRACKER)
    if not os.path.exists(tracker):
        return None
    with open(tracker) as f:
        return int(f.read().strip())


def apply_optimizer_flags(train: TrainConfig, optimizer: torch.optim.Optimizer, schedule: LRSchedule) -> None:
    """Loaded param_groups carry the saved hyper-parameters: the schedule refused a change unless
    --override-opt-param-scheduler, which makes the flags' values count; the schedule decides the lr."""
    cfg = train.optimizer
    for group in optimizer.param_groups:
        if train.override_opt_param_scheduler:
            group["weight_decay"] = cfg.weight_decay
            if cfg.optimizer == "sgd":
                group["momentum"] = cfg.sgd_momentum
            else:
                group.update(betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps)
        group["lr"] = schedule.lr


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def checkpoint_dtype(config: Any) -> torch.dtype:
    """The dtype a Hugging Face config declares for its weights (float32 when it declares none)."""
    declared = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(declared, torch.dtype):
        return declared
    if isinstance(declared, str) and isinstance(getattr(torch, declared, None), torch.dtype):
        return getattr(torch, declared)
    return torch.float32
