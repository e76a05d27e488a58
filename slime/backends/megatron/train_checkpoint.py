"""The train ranks' own checkpoints of the Megatron backend: `--save` / `--load` (resumable, in
Megatron-LM's layout: slime.backends.megatron.checkpoint) and `--save-hf`. Every rank takes part;
the replica of data-parallel rank 0 writes, and an error on one rank is raised on all of them."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Iterable
from typing import Any

import torch

from slime.backends.checkpointing import TRACKER
from slime.backends.megatron.checkpoint import (
    is_vision_language,
    megatron_args,
    rank_dir,
    save_hf,
    stored_layout,
    vision_language_state,
)
from slime.backends.megatron.convert import ConversionError, Layout, State


def _own_dir(actor: Any) -> str:
    mesh = actor.mesh
    return rank_dir(mesh.tp_rank, mesh.pp_rank, actor.pp, mesh.ep_rank if actor.ep > 1 else None)


TRAIN_FORMAT_VERSION = 1


def save_train_checkpoint(actor: Any, rollout_id: int, root: str, extra: dict[str, Any] | None = None) -> str:
    """`--save` for the Megatron actor, in Megatron-LM's layout:

        ROOT/latest_checkpointed_iteration.txt        the rollout id of the newest complete one
        ROOT/iter_0000007/mp_rank_TT[_PPP]/model_optim_rng.pt

    Each file (written by the replica of data-parallel rank 0) holds its rank's model shard
    ("model", megatron-core names; with --bf16 also "main_params", the float32 master weights),
    "optimizer" (AdamW's state for exactly these tensors),
    "opt_param_scheduler", "rng_state", "iteration", "args" (megatron_args) and "slime" (format,
    extra, hf_checkpoint). The directory is written as iter_XXXXXXX.partial and renamed by rank 0
    after every rank finished; the tracker is replaced after that. convert_checkpoint reads it
    (model only) to change the layout.
    """
    import torch.distributed as dist

    from slime.backends.checkpointing import broadcast_error, start_save
    from slime.utils.files import atomic_write_text

    final, partial = start_save(root, rollout_id, actor.rank)
    error = None
    # With expert parallelism the experts differ across data-parallel ranks: one rank per
    # expert data-parallel group writes (its file holds its dense shard and its experts).
    mesh = actor.mesh
    # (context-parallel ranks hold the same weights: CP rank 0 writes; megatron-core's expert
    # data-parallel group spans them already)
    writes = (
        mesh.expert_dp_rank == 0 if actor.layout.num_experts else actor.dp_rank == 0 and actor.cp_rank == 0
    )
    coords = (mesh.tp_rank, mesh.pp_rank, mesh.ep_rank, mesh.etp_rank)
    everyone = _gather((coords, writes))
    written = {c for c, w in everyone if w}
    lacking = sorted({c for c, _ in everyone} - written)
    if len({c[:3] for c in written}) < len(written):
        lacking = lacking or sorted(written)  # two writers of one directory (same TP, PP, EP rank)
    if lacking:  # a layout whose files cannot hold every rank's (TP, PP, EP, ETP) part
        raise ConversionError(
            f"--save {root!r}: no rank writes the part (tp, pp, ep, etp) {lacking[0]} with TP {actor.tp}, EP "
            f"{actor.ep}, ETP {actor.etp}: use --expert-tensor-parallel-size 1 or the tensor-parallel size"
        )
    if writes:
        folder = os.path.join(partial, _own_dir(actor))
        try:
            _write_shard(actor, folder, rollout_id, extra)
        except Exception as e:  # a full disk, an unpicklable `extra`, host memory: every rank must hear of it
            error = f"--save {root!r}: rank {actor.rank} cannot write its shard ({type(e).__name__}: {e})"
    _agree(error)  # every rank raises a writer's error; none waits for one that failed
    if actor.rank == 0:
        expected = sorted({rank_dir(t, s, actor.pp, e if actor.ep > 1 else None) for t, s, e, _ in written})
        missing = [d for d in expected if not os.path.isfile(os.path.join(partial, d, "model_optim_rng.pt"))]
        if missing:
            error = (
                f"--save {root!r}: shards {missing} are not in {partial} (is --save on a filesystem every "
                "node shares?); the checkpoint is not published"
            )
    broadcast_error(error)
    if actor.rank == 0:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(partial, final)
        atomic_write_text(os.path.join(root, TRACKER), str(rollout_id))
    dist.barrier()
    return final


def _write_shard(actor: Any, folder: str, rollout_id: int, extra: dict[str, Any] | None) -> None:
    from slime.backends.checkpointing import rng_state

    blob = {
        "model": {k: v.detach().cpu() for k, v in actor.model_state().items()},
        # --bf16: the float32 master weights the optimizer steps (the model holds them rounded).
        "main_params": {
            n: actor.masters[p].detach().cpu()
            for n, p in actor.model.named_parameters()
            if p in actor.masters
        }
        or None,
        "optimizer": actor.optimizer.state_dict(),
        "opt_param_scheduler": actor.schedule.state_dict(),
        "rng_state": rng_state(),
        "iteration": rollout_id,
        "checkpoint_version": 3.0,
        "args": megatron_args(actor.layout, actor.tp, actor.pp, actor.ep, actor.etp, actor.value_head),
        "slime": {
            "format_version": TRAIN_FORMAT_VERSION,
            "extra": extra or {},
            "hf_checkpoint": actor.cfg.hf_checkpoint,
            "data_parallel_size": actor.dp_size,
        },
    }
    os.makedirs(folder, exist_ok=True)
    torch.save(blob, os.path.join(folder, "model_optim_rng.pt"))


def load_train_checkpoint(actor: Any, root: str) -> int | None:
    """Resume from the newest checkpoint under `root` (None when there is none yet).

    A checkpoint written by the actor resumes everything; a converted one (`release`, from
    convert_hf_to_megatron / convert_checkpoint) loads the model only and starts a fresh run from
    it. The TP/PP layout must be the one the job runs (convert_checkpoint changes it)."""
    from slime.backends.checkpointing import set_rng_state

    tracker = os.path.join(root, TRACKER)
    seen = _gather(os.path.isfile(tracker))
    if any(seen) and not all(seen):
        raise ConversionError(
            f"--load {root!r}: ranks {[r for r, s in enumerate(seen) if not s]} do not see "
            f"{TRACKER} (is --load on a filesystem every node shares?)"
        )
    if not seen[0]:
        return None
    with open(tracker) as f:
        tag = f.read().strip()
    blob: dict[str, Any] = {}
    error = None
    try:
        blob, error = _read_shard(actor, root, tag)
    except Exception as e:  # a truncated or corrupt file: every rank must hear of it
        error = f"--load {root!r}: rank {actor.rank} cannot read its shard ({type(e).__name__}: {e})"
    _agree(error)  # the same error on every rank: none goes on to wait for the others
    # the float32 master weights where --bf16 saved them; the buffers (expert bias) from the model's
    state = {**blob["model"], **(blob.get("main_params") or {})}
    if tag == "release" and getattr(actor, "lora", None) is not None:  # a base model: fresh adapters
        state = {**actor.lora.initial, **state}
    actor.copy_in(state, masters=True)
    if tag == "release" or "optimizer" not in blob:
        return None
    # The settings first: a changed --optimizer must be refused before torch loads its state.
    actor.schedule.load_state_dict(
        blob["opt_param_scheduler"], override=actor.cfg.override_opt_param_scheduler
    )
    actor.optimizer.load_state_dict(blob["optimizer"])
    from slime.backends.checkpointing import apply_optimizer_flags

    apply_optimizer_flags(actor.cfg, actor.optimizer, actor.schedule)
    set_rng_state(blob["rng_state"])
    actor.resumed_extra = blob.get("slime", {}).get("extra", {})
    return int(blob["iteration"])


def _read_shard(actor: Any, root: str, tag: str) -> tuple[dict[str, Any], str | None]:
    """This rank's file of the tracked iteration, or the reason it cannot be used."""
    from slime.backends.checkpointing import iteration_dir

    folder = os.path.join(root, "release") if tag == "release" else iteration_dir(root, int(tag))
    path = os.path.join(folder, _own_dir(actor), "model_optim_rng.pt")
    stages = "".join(
        f" --target-decoder-{end}-pipeline-num-layers {n}"
        for end, n in zip(
            ("first", "last"), (actor.layout.first_stage_layers, actor.layout.last_stage_layers)
        )
        if n
    )
    convert = (
        f"convert it with python -m slime.tools.convert_checkpoint --target-tensor-parallel-size {actor.tp} "
        f"--target-pipeline-parallel-size {actor.pp}{stages}"
    )
    if actor.value_head:  # the tools take language models only
        convert = (
            "a critic's checkpoint is not converted: resume at the layout it was saved with, or start the "
            "critic afresh from its --save-hf export (--critic-load; its optimizer state starts over)"
        )
    if not os.path.isfile(path):
        stored = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
        return {}, (
            f"--load {root!r}: no {os.path.relpath(path, root)} for TP {actor.tp} x PP {actor.pp} (the "
            f"checkpoint holds {', '.join(stored) or 'nothing'}); {convert}"
        )
    blob = torch.load(path, map_location="cpu", weights_only=False)
    args = blob.get("args") or {}
    saved = (
        args.get("tensor_model_parallel_size"),
        args.get("pipeline_model_parallel_size"),
        args.get("expert_model_parallel_size", 1),
        args.get("expert_tensor_parallel_size") or args.get("tensor_model_parallel_size"),
    )
    try:
        saved_layout = stored_layout(args, root)

        # The same model with the same layers on each stage (a split named two ways is one split).
        def unsplit(layout: Layout) -> Layout:
            return dataclasses.replace(layout, first_stage_layers=None, last_stage_layers=None)

        same_model = unsplit(saved_layout) == unsplit(actor.layout) and (
            saved_layout.stages(actor.pp) == actor.layout.stages(actor.pp)
        )
    except (ConversionError, TypeError) as e:
        return {}, f"--load {root!r}: {e}"
    if bool(args.get("value_head")) != actor.value_head:
        kinds = ("an actor's", "a critic's") if actor.value_head else ("a critic's", "an actor's")
        return {}, (
            f"--load {root!r} holds {kinds[0]} checkpoint (its output layer), not {kinds[1]}: the critic "
            "resumes from <--load>/critic or --critic-save, the actor from --load"
        )
    if saved != (actor.tp, actor.pp, actor.ep, actor.etp) or not same_model:
        return {}, (
            f"--load {root!r} was saved with TP {saved[0]} x PP {saved[1]} x EP {saved[2]} x ETP "
            f"{saved[3]} or for another model layout than {actor.cfg.hf_checkpoint!r} at TP {actor.tp} x "
            f"PP {actor.pp} x EP {actor.ep} x ETP {actor.etp}: {convert}"
        )
    return blob, None


def _gather(value: Any) -> list[Any]:
    """Every rank's `value`, on every rank (collective)."""
    import torch.distributed as dist

    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def _agree(error: str | None) -> None:
    """Raise on every rank the first error any rank found (collective)."""
    first = next((e for e in _gather(error) if e), None)
    if first:
        raise ConversionError(first)


def save_hf_from_actor(
    actor: Any,
    path: str,
    shard_bytes: int = 2 << 30,
    tensors: Iterable[tuple[str, torch.Tensor]] | None = None,
    config: Any = None,
) -> None:
    """The actor's weights as a Hugging Face directory (rank 0 writes; every rank takes part).
    `tensors`: the (HF name, full tensor) pairs to write instead of the actor's export (they come
    on rank 0), `config`: the config to write instead of --hf-checkpoint's (both: the critic's).
    A released Qwen3.5 checkpoint's language model is written as that checkpoint again: its
    names, config and vision tower (checkpoint.vision_language_state)."""
    import torch.distributed as dist

    from slime.backends.checkpointing import checkpoint_dtype

    if tensors is None:
        tensors = (pair for bucket in actor.export_weights(shard_bytes) for pair in bucket)
    state: State = {n: t.detach().cpu() for n, t in tensors}
    if actor.rank == 0 and is_vision_language(actor.cfg.hf_checkpoint):
        state, config = vision_language_state(state, actor.cfg.hf_checkpoint), None
    if actor.rank == 0:
        dtype = checkpoint_dtype(actor.hf_config)
        final = os.path.abspath(path)
        if os.path.exists(final):
            shutil.rmtree(final)
        save_hf(
            {n: t.to(dtype) for n, t in state.items()}, actor.cfg.hf_checkpoint, final, shard_bytes, config
        )
    dist.barrier()
