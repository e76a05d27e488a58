"""Vision-language models in the FSDP actor: the images' inputs of a micro-batch and the vision
tower's place in the forward.

A sample with images carries the processor's tensors (`RolloutBatch.multimodal_train_inputs`:
`pixel_values`, `image_grid_thw`) and token ids with each image's run of pad tokens. A micro-batch
takes its samples' tensors in sample order, and each sample's multimodal rotary positions from the
model's own `get_rope_index` (three rows: time, height, width), restarting at 0 for each sample
as the text positions do when packed. Packed rows go in with four rows of positions, the text
positions first (what transformers' Qwen-VL models read the samples' boundaries from).

The vision tower runs inside the model's forward (FSDP gathers its parameters there); its own
attention is plain sdpa over each image's patches, never the packed text attention. It is frozen
(its activations keep no graph) unless `--train-vision-model`.
"""

from __future__ import annotations

from typing import Any

import torch

from slime.backends.micro_batch import MicroBatch
from slime.utils.rollout_batch import BatchError, RolloutBatch


def vision_tower(model: Any) -> torch.nn.Module | None:
    """The vision encoder of a transformers vision-language model (None for a text model)."""
    inner = getattr(model, "model", None)
    return getattr(inner, "visual", None)


def set_up_vision_tower(model: Any, train: bool) -> None:
    """Freeze the vision tower (`train` False: --train-vision-model not given). A trained one
    gets no gradient on a rank whose micro-batch has no image while another rank's has: FSDP
    then reduce-scatters zeros for it, so every rank joins the same collectives."""
    from slime.backends.fsdp.model_init import fsdp_modules

    tower = vision_tower(model)
    if tower is None:
        return
    if not train:
        tower.requires_grad_(False)
        return
    for module in fsdp_modules(model):
        module.set_reduce_scatter_unused_params(True, recurse=False)


def attach_images(model: Any, mb: MicroBatch, batch: RolloutBatch) -> None:
    """Set `mb.vision` for a micro-batch of a rollout with images: the samples' pixel values and
    grids, and the rotary positions of every token."""
    inputs = batch.multimodal_train_inputs
    if inputs is None:
        return
    config = model.config
    tokens = [batch.tokens[p] for p in mb.positions]
    per_sample = [inputs[p] for p in mb.positions]
    pixels = [s["pixel_values"] for s in per_sample if s]
    grids = [s["image_grid_thw"] for s in per_sample if s]
    names = batch.sample_indices or list(range(len(batch)))
    positions = [
        _rope_positions(model, config, ids, s["image_grid_thw"] if s else None, names[p])
        for p, ids, s in zip(mb.positions, tokens, per_sample)
    ]
    device = mb.input_ids.device
    if mb.packed:
        tail = mb.input_ids.shape[1] - sum(len(t) for t in tokens)
        rows = torch.cat([*positions, torch.arange(tail).view(1, -1).expand(3, -1)], dim=1)
        assert mb.position_ids is not None
        position_ids = torch.cat([mb.position_ids.cpu(), rows], dim=0)[:, None].to(device)  # [4, 1, T]
    else:
        position_ids = torch.zeros((3, *mb.input_ids.shape), dtype=torch.long)
        for row, pos in enumerate(positions):
            position_ids[:, row, : pos.shape[1]] = pos
        position_ids = position_ids.to(device)
    mb.vision = {"position_ids": position_ids}
    if pixels:
        mb.vision["pixel_values"] = torch.cat(pixels).to(device)
        mb.vision["image_grid_thw"] = torch.cat(grids).to(device)


def _rope_positions(
    model: Any, config: Any, ids: list[int], grid: torch.Tensor | None, name: int
) -> torch.Tensor:
    """[3, len(ids)]: the model's multimodal rotary positions of one sample (`name`: its index)."""
    t = torch.tensor([ids])
    merge = int(config.vision_config.spatial_merge_size) ** 2
    needed = int(sum(int(g.prod()) // merge for g in grid)) if grid is not None else 0
    held = int((t == config.image_token_id).sum())
    video = int((t == getattr(config, "video_token_id", -1)).sum())
    # The placeholder in a response (an engine that samples it), or ids and images that do not
    # belong together.
    if held != needed or video:
        raise BatchError(
            f"sample {name} holds {held} image and {video} video placeholder tokens (ids "
            f"{config.image_token_id}, {getattr(config, 'video_token_id', None)}) but its images fill "
            f"{needed} and videos are not built: its token ids and multimodal_train_inputs do not belong "
            "together, or its response holds a placeholder (the torch engine never samples one; an "
            "SGLang engine may)"
        )
    types = (t == config.image_token_id).int() + 2 * (t == getattr(config, "video_token_id", -1)).int()
    positions, _ = model.model.get_rope_index(t, types, image_grid_thw=grid)
    return positions[:, 0]
