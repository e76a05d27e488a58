"""A train rank's start-up, what every backend does the same way around building its model."""

from __future__ import annotations

import logging
from typing import Any

import torch

from slime.backends import hf_checkpoint
from slime.config.opd import OTHER_ARCHITECTURE
from slime.config.train import TrainConfig

logger = logging.getLogger(__name__)


def check_files(cfg: TrainConfig) -> Any:
    """The checks that read only files (--hf-checkpoint, --ref-load, --opd-teacher-load), run
    before the process group exists: a bad flag is then the same error on every rank, never a
    hang. Returns the checkpoint's Hugging Face config."""
    hf_config = hf_checkpoint.check_hf_checkpoint(cfg.hf_checkpoint)
    if cfg.ref_load and cfg.loss.needs_ref:
        hf_checkpoint.check_hf_checkpoint(cfg.ref_load, "--ref-load")
    if cfg.opd.in_train:
        assert cfg.opd.teacher_load is not None  # slime.config.opd checked
        hf_checkpoint.check_same_architecture(
            hf_config, cfg.opd.teacher_load, "--opd-teacher-load", OTHER_ARCHITECTURE
        )
    return hf_config


def seed_device(cfg: TrainConfig) -> torch.device:
    """Seed this rank (--seed; deterministic kernels with --deterministic-mode) and return its
    device (the current CUDA device, or the CPU)."""
    if cfg.deterministic:
        from slime.utils.seed import enable_deterministic

        enable_deterministic(cfg.seed)
    torch.manual_seed(cfg.seed)
    return torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")


def ready(name: str, rank: Any, resumed: int | None, **layout: int) -> dict[str, Any]:
    """The facts of the start-up banner (its parallel `layout`, parameter count, memory, the
    checkpoint resumed from), logged once per rank."""
    info = {
        "rank": rank.rank,
        "world_size": rank.world_size,
        "dp_rank": rank.dp_rank,
        **layout,
        "dp": rank.dp_size,
        "num_parameters": sum(p.numel() for p in rank.model.parameters()),
        "local_state_bytes": rank.local_state_bytes(),
        "resumed_rollout_id": resumed,
        "resumed_extra": rank.resumed_extra,
    }
    logger.info("rank %d/%d: %s actor ready %s", rank.rank, rank.world_size, name, info)
    return info
