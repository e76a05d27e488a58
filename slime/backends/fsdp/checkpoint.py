"""Checkpoints of the FSDP actor, Hugging Face export, and the weight-export iterator.

Layout of `--save DIR` (Megatron's, so tools and habits carry over):

    DIR/latest_checkpointed_iteration.txt     rollout id of the newest complete checkpoint
    DIR/iter_0000007/model_optim/             torch.distributed.checkpoint (sharded, reshardable)
    DIR/iter_0000007/trainer_state.pt         LR schedule, rollout id, world size, RNG per rank

A checkpoint is written into `iter_XXXXXXX.partial` and renamed by rank 0 only after every
rank finished, and the tracker file is replaced atomically after that: an interrupted save
never becomes the one a resume picks. DCP stores each shard with its global offsets, so a
checkpoint saved by N ranks loads on M ranks.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.distributed as dist

from slime.backends.checkpointing import (
    TRACKER,
    apply_optimizer_flags,
    checkpoint_dtype,
    iteration_dir,
    latest_rollout_id,
    rng_state,
    set_rng_state,
    start_save,
)
from slime.backends.optim import LRSchedule
from slime.config.train import TrainConfig
from slime.utils import hf_experts
from slime.utils.buckets import iter_buckets
from slime.utils.files import atomic_write_text

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1


class Rank(Protocol):
    """What a checkpoint reads and writes of an FSDP rank (slime.backends.fsdp.actor.FSDPBackend)."""

    cfg: TrainConfig
    hf_config: Any
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    schedule: LRSchedule
    rank: int
    world_size: int
    resumed_extra: dict[str, Any]


def save_checkpoint(actor: Rank, rollout_id: int, root: str, extra: dict[str, Any] | None = None) -> str:
    """Save; `extra` (plain data, e.g. the data position) is stored with the trainer state and
    becomes visible atomically with the rest."""
    import torch.distributed.checkpoint as dcp

    final, partial = start_save(root, rollout_id, actor.rank)
    model_state, optim_state = _states(actor, _state_options(actor))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(partial, "model_optim"))
    rng = [None] * actor.world_size
    dist.all_gather_object(rng, rng_state())
    if actor.rank == 0:
        state = {
            "format_version": FORMAT_VERSION,
            "rollout_id": rollout_id,
            "world_size": actor.world_size,
            "schedule": actor.schedule.state_dict(),
            "rng": rng,
            "hf_checkpoint": actor.cfg.hf_checkpoint,
            "lora": _lora_shape(actor),
            "extra": extra or {},
        }
        torch.save(state, os.path.join(partial, "trainer_state.pt"))
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)
        atomic_write_text(os.path.join(root, TRACKER), str(rollout_id))
        logger.info("saved checkpoint %s (%d ranks)", final, actor.world_size)
    dist.barrier()
    return final


def load_checkpoint(actor: Rank, root: str) -> int | None:
    """Resume model, optimizer, schedule and RNG from the newest checkpoint under `root`.

    Returns the rollout id it was saved at, or None when `root` has no checkpoint yet (a fresh
    run with --load pointing at its own --save directory starts from --hf-checkpoint).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if not os.path.isdir(root):
        logger.info("--load %s does not exist yet: starting from --hf-checkpoint", root)
        return None
    rollout_id = latest_rollout_id(root)
    if rollout_id is None:
        logger.info("--load %s has no %s yet: starting from --hf-checkpoint", root, TRACKER)
        return None
    directory = iteration_dir(root, rollout_id)
    state_file = os.path.join(directory, "trainer_state.pt")
    if not os.path.exists(state_file):
        raise FileNotFoundError(
            f"--load {root!r}: {TRACKER} names rollout {rollout_id} but {state_file} is missing"
        )
    state = torch.load(state_file, weights_only=False)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{state_file}: format_version {state.get('format_version')}, expected {FORMAT_VERSION}"
        )
    if state.get("lora") != _lora_shape(actor):
        raise ValueError(
            f"--load {root!r} was saved with LoRA {state.get('lora') or 'off'}, this run has "
            f"{_lora_shape(actor) or 'no LoRA'}: resume with the flags it was saved with (--lora-rank, "
            "--lora-alpha, --target-modules, --target-parameters, --exclude-modules)"
        )
    base = state.get("hf_checkpoint")
    if (
        actor.cfg.lora.enabled
        and base
        and os.path.realpath(base) != os.path.realpath(actor.cfg.hf_checkpoint)
    ):
        raise ValueError(
            f"--load {root!r} holds LoRA adapters trained on {base!r}, not on --hf-checkpoint "
            f"{actor.cfg.hf_checkpoint!r}: resume with the base model they were trained on"
        )
    actor.schedule.load_state_dict(state["schedule"], override=actor.cfg.override_opt_param_scheduler)
    options = _state_options(actor)
    model_state, optim_state = _states(actor, options)
    # dcp.load fills these dicts in place (tensors are loaded into the local shards' layout).
    dcp.load(
        {"model": model_state, "optim": optim_state}, checkpoint_id=os.path.join(directory, "model_optim")
    )
    set_state_dict(
        actor.model,
        actor.optimizer,
        model_state_dict=model_state,
        optim_state_dict=optim_state,
        options=options,
    )
    apply_optimizer_flags(actor.cfg, actor.optimizer, actor.schedule)
    rng = state["rng"]
    if state["world_size"] == actor.world_size:
        set_rng_state(rng[actor.rank])
    else:
        logger.warning(
            "checkpoint saved by %d ranks, resumed on %d: RNG streams restart from rank 0's state",
            state["world_size"],
            actor.world_size,
        )
        set_rng_state(rng[0])
    logger.info(
        "resumed %s (saved by %d ranks) on %d ranks", directory, state["world_size"], actor.world_size
    )
    actor.resumed_extra = state.get("extra", {})
    return rollout_id


def _state_options(actor: Rank) -> Any:
    """What a checkpoint holds: every parameter, or with LoRA the adapters alone (the base
    weights are frozen: --hf-checkpoint has them), with their optimizer state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    lora = actor.cfg.lora.enabled
    return StateDictOptions(ignore_frozen_params=lora, strict=not lora)


def _states(actor: Rank, options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizer's state dicts as a checkpoint holds them. With LoRA the
    frozen weights are left out (torch keeps a tied one, the LM head, under its second name)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(actor.model, actor.optimizer, options=options)
    if actor.cfg.lora.enabled:
        from slime.backends.fsdp.lora import is_adapter

        model_state = {k: v for k, v in model_state.items() if is_adapter(k)}
    return model_state, optim_state


def _lora_shape(actor: Rank) -> dict[str, Any] | None:
    """The LoRA settings that shape a checkpoint's tensors and what they mean (None: no LoRA)."""
    lo = actor.cfg.lora
    if not lo.enabled:
        return None
    shape: dict[str, Any] = {
        "rank": lo.rank,
        "alpha": lo.alpha,
        "target_modules": list(lo.target_modules),
        "exclude_modules": list(lo.exclude_modules),
    }
    if lo.target_parameters:  # (only when given: checkpoints from before the flag resume)
        shape["target_parameters"] = list(lo.target_parameters)
    return shape


# ---- weights out ------------------------------------------------------------------------------
def export_weight_buckets(
    model: torch.nn.Module,
    bucket_bytes: int,
    dtype: torch.dtype | None = None,
    merge: Callable[[Iterator[tuple[str, torch.Tensor]]], Iterator[tuple[str, torch.Tensor]]] | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield [(HF checkpoint name, full tensor)] buckets of at most `bucket_bytes` (a larger
    tensor alone).

    Every rank must iterate: each tensor is all-gathered when its bucket is built, so at most
    one bucket of full tensors exists at a time. Tied parameters are yielded once, under the
    name `named_parameters()` gives (the one a Hugging Face save keeps). Fused expert
    parameters go out one tensor per expert, under the checkpoint's names (slime.utils.hf_experts).
    `merge` maps the stream of (parameter name, full tensor) to checkpoint tensors (LoRA: the
    adapters merged into their base weights, slime.backends.fsdp.lora.merged).
    """
    if bucket_bytes < 1:
        raise ValueError(f"--update-weight-buffer-size must be >= 1 byte, got {bucket_bytes}")

    def gathered() -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in model.named_parameters():
            yield name, (param.full_tensor() if hasattr(param, "full_tensor") else param).detach()

    def cast(named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, full in named:
            yield name, full.to(dtype) if dtype else full

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    # The checkpoint's buffers (an expert-score bias) go in their own dtype, as checkpoints keep them.
    buffers = ((name, buf.detach()) for name, buf in hf_experts.persistent_buffers(model))
    tensors = itertools.chain(cast(merge(gathered()) if merge is not None else gathered()), buffers)
    return iter_buckets(hf_experts.checkpoint_tensors(model_type, tensors), bucket_bytes)


def save_hf_checkpoint(
    actor: Rank,
    path: str,
    shard_bytes: int = 2 << 30,
    merge: Callable[[Iterator[tuple[str, torch.Tensor]]], Iterator[tuple[str, torch.Tensor]]] | None = None,
) -> None:
    """A plain Hugging Face directory: safetensors (sharded past `shard_bytes`), config, tokenizer;
    `merge`: the LoRA adapters merged into their base weights (--lora-save-merged).

    Written into a temporary sibling directory and renamed when complete.
    """
    from safetensors.torch import save_file

    final = os.path.abspath(path)
    partial = final + ".partial"
    if actor.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    files: list[list[str]] = []
    index: dict[str, str] = {}
    dtype = checkpoint_dtype(actor.hf_config)
    for bucket in export_weight_buckets(actor.model, shard_bytes, dtype, merge):
        if actor.rank == 0:
            files.append([n for n, _ in bucket])
            name = f"model-{len(files):05d}.safetensors"
            save_file(
                {n: t.contiguous().cpu() for n, t in bucket},
                os.path.join(partial, name),
                metadata={"format": "pt"},
            )
            index.update(dict.fromkeys(files[-1], name))
    if actor.rank == 0:
        _finish_hf_dir(actor, partial, final, index, len(files))
    dist.barrier()


def _finish_hf_dir(actor: Rank, partial: str, final: str, index: dict[str, str], num_files: int) -> None:
    if num_files == 1:
        os.replace(
            os.path.join(partial, "model-00001.safetensors"), os.path.join(partial, "model.safetensors")
        )
    else:
        renamed = {}
        for k in range(1, num_files + 1):
            new = f"model-{k:05d}-of-{num_files:05d}.safetensors"
            os.replace(os.path.join(partial, f"model-{k:05d}.safetensors"), os.path.join(partial, new))
            renamed[f"model-{k:05d}.safetensors"] = new
        with open(os.path.join(partial, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": {n: renamed[v] for n, v in index.items()}}, f, indent=2)
    actor.hf_config.save_pretrained(partial)
    source = actor.cfg.hf_checkpoint
    for name in os.listdir(source):
        if name.startswith(
            (
                "tokenizer",
                "special_tokens",
                "vocab",
                "merges",
                "chat_template",
                "generation_config",
                "preprocessor_config",
                "video_preprocessor_config",
                "processor_config",
            )  # a VLM's processor
        ):
            shutil.copy2(os.path.join(source, name), os.path.join(partial, name))
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(partial, final)
    logger.info("saved Hugging Face checkpoint %s (%d files)", final, num_files)
