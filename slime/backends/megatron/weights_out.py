"""What leaves the Megatron actor under Hugging Face names: the weight push (`export_weights`),
`--save-hf` and the LoRA adapter.

The model's tensors stream out as slime.backends.megatron.export gathers them; on the way:

- with LoRA (slime.backends.megatron.lora) each adapter merges into its base weight (the push
  and --lora-save-merged), or the adapters go out alone under PEFT's names (--lora-push
  adapter, --save-hf's adapter directory); each pipeline stage's adapters are gathered first;
- a released Qwen3.5 checkpoint's language model takes the checkpoint's names, and the push
  its vision tower as loaded (checkpoint.as_stored).

Every function is collective: every rank calls it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from slime.backends.megatron import checkpoint as mckpt
from slime.backends.megatron import lora, lora_experts, mtp, train_checkpoint
from slime.backends.megatron.export import export_hf_tensors, meta_hf_state
from slime.utils.buckets import iter_buckets

Named = Iterator[tuple[str, torch.Tensor]]


def export_weights(
    actor: Any, bucket_bytes: int, every_rank: bool = False
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    named = _tensors(actor, every_rank, with_mtp=False)
    yields = every_rank or actor.rank == 0
    return iter_buckets(mckpt.as_stored(named, actor.cfg.hf_checkpoint, yields), bucket_bytes)


def _tensors(actor: Any, every_rank: bool, with_mtp: bool) -> Named:
    """The model's HF tensors (LoRA: merged), on rank 0 (every rank with `every_rank`)."""
    local = {k: v.detach() for k, v in actor.model_state().items()}
    named = export_hf_tensors(local, actor.layout, actor.mesh, every_rank, with_mtp)
    if actor.lora is None:
        return named
    held = adapters(actor)
    scaling = actor.cfg.lora.scaling
    linear = lora.merged(named, held, scaling)  # (a router's adapter merges as a linear layer's)
    num_experts = actor.layout.num_experts
    return lora_experts.merged(
        linear, held, actor.lora.wrapped, actor.hf_config.model_type, num_experts, scaling
    )


def weight_shapes(actor: Any) -> dict[str, tuple[int, ...]]:
    shapes = {name: tuple(t.shape) for name, t in meta_hf_state(actor.layout, with_mtp=False).items()}
    return mckpt.stored_shapes(shapes, actor.cfg.hf_checkpoint)


def adapters(actor: Any) -> dict[str, torch.Tensor]:
    """Every stage's adapters on every rank (PEFT's model-side names; each stage's first rank
    sends its own: they are small)."""
    import torch.distributed as dist

    first = actor.mesh.tp_rank == 0 and actor.dp_rank == 0 and actor.cp_rank == 0
    mine = {n: t.cpu() for n, t in actor.lora.state(actor.masters).items()} if first else {}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {n: t for stage in everyone for n, t in stage.items()}


def export_adapter(actor: Any) -> tuple[list[tuple[str, torch.Tensor]], dict[str, Any]]:
    """LoRA: the adapters whole under PEFT's names, and their PEFT config."""
    from slime.backends.fsdp import lora as peft_lora

    if actor.lora is None:
        from slime.utils.errors import UsageError

        raise UsageError("the adapter push needs LoRA (--lora-rank)")
    named = [(peft_lora.peft_name(n), t) for n, t in sorted(adapters(actor).items())]
    return named, peft_lora.adapter_config_dict(actor.lora.peft_config, actor.cfg.hf_checkpoint)


def save_hf(actor: Any, path: str) -> None:
    """--save-hf: the Hugging Face model (with the MTP modules built: a push leaves them out);
    with LoRA a PEFT adapter directory, and with --lora-save-merged the merged model in its
    `merged/`, as the FSDP actor writes them."""
    import torch.distributed as dist

    config = mtp.saved_config(actor.hf_config, actor.layout)
    if actor.lora is None:
        tensors = _tensors(actor, every_rank=False, with_mtp=True)
        train_checkpoint.save_hf_from_actor(actor, path, tensors=tensors, config=config)
        return
    named, adapter_config = export_adapter(actor)
    if actor.rank == 0:
        from slime.utils.peft_files import write_adapter_dir

        write_adapter_dir(path, adapter_config, dict(named))
    dist.barrier()
    if actor.cfg.lora.save_merged:
        tensors = _tensors(actor, every_rank=False, with_mtp=True)
        train_checkpoint.save_hf_from_actor(
            actor, os.path.join(path, "merged"), tensors=tensors, config=config
        )
