"""Images in prompts (`--multimodal-keys`, as slime reads it).

A row names its images in the fields `--multimodal-keys` maps each modality to
(`{"image": "images"}`: `row["images"]`, a list). Each `<image>` placeholder of the prompt's text
takes the next image, in order, and becomes an image content item of its message
(`{"type": "image", "image": ...}`); an item may be a path, a URL, base64, a data URL, or a dict:
Qwen-VL's own item (`{"type": "image", "image": ...}`, kept as it is; its per-image sizes
`min_pixels` ... are refused, not applied) or Hugging Face datasets' image record
(`{"bytes": ..., "path": ...}`, how parquet stores an image column). The counts must agree.
The driver decodes every image and passes it through the checkpoint's image processor before
anything starts, so a missing, corrupt or refused image is one error naming the row and the file.

What generation then needs of a prompt's images (the engine's `image_data`, the trainer's
tensors, the expanded ids) is slime.utils.processing_utils's `prompt_images` and
`expanded_prompt_ids`, made once per prompt group and shared by its samples.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from typing import Any

from slime.utils.data_files import DataError

PLACEHOLDERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}
RESIZE_KEYS = {"min_pixels", "max_pixels", "resized_height", "resized_width"}


def messages_with_images(
    where: str, messages: list[Any], row: Mapping[str, Any], keys: Mapping[str, str], processor: Any = None
) -> tuple[list[Any], list[Any]]:
    """`messages` with each `<image>` replaced by the row's next image as a content item, and the
    decoded images in order (`processor`: also checked by the model's image processor). DataError
    names the row, the field and the file."""
    from slime.utils.processing_utils import ImageError, load_image

    for modality in keys:
        if modality != "image":
            raise DataError(f"--multimodal-keys: modality {modality!r} is not supported (images only)")
    field = keys.get("image")
    items = row.get(field) if field is not None else None
    if items is None:
        items = []
    if isinstance(items, str | dict) or not hasattr(items, "__iter__"):
        items = [items]
    items = list(items.tolist() if hasattr(items, "tolist") else items)
    messages = copy.deepcopy(list(messages))
    remaining = list(items)
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, str):
            continue
        parts: list[dict[str, Any]] = []
        for piece in re.split(f"({re.escape(PLACEHOLDERS['image'])})", content):
            if piece == PLACEHOLDERS["image"]:
                if not remaining:
                    raise DataError(
                        f"{where}: the prompt has more <image> placeholders than field {field!r} "
                        f"has images ({len(items)}) (--multimodal-keys)"
                    )
                item = remaining.pop(0)
                qwen_item = isinstance(item, dict) and item.get("type") == "image"
                parts.append(dict(item) if qwen_item else {"type": "image", "image": item})
            elif piece:
                parts.append({"type": "text", "text": piece})
        message["content"] = parts
    if remaining:
        raise DataError(
            f"{where}: field {field!r} has {len(items)} images but the prompt has only "
            f"{len(items) - len(remaining)} <image> placeholders (--multimodal-keys)"
        )
    images = []
    for i, item in enumerate(items):
        sizing = (
            sorted(RESIZE_KEYS & set(item)) if isinstance(item, dict) and item.get("type") == "image" else []
        )
        if sizing:
            raise DataError(
                f"{where}: field {field!r}[{i}]: {sizing} (Qwen-VL's per-image sizes) are not applied here: "
                "give the image alone (the checkpoint's processor sizes it) or resize it beforehand"
            )
        try:
            images.append(load_image(item))
            if processor is not None:  # the checks it makes (aspect ratio, size), now rather than mid-run
                processor.image_processor(images=[images[-1]], return_tensors="pt")
        except (ImageError, ValueError) as e:
            raise DataError(f"{where}: field {field!r}[{i}]: {e}") from None
    return messages, images


def checked_processor(hf_checkpoint: str) -> Any:
    """The checkpoint's processor, which --multimodal-keys needs (DataError when it has none, or
    when its model is not a vision-language family this project runs with images)."""
    from transformers import AutoConfig

    from slime.utils.model_families import FAMILIES, is_vision
    from slime.utils.processing_utils import load_processor

    try:
        model_type = AutoConfig.from_pretrained(hf_checkpoint).model_type
    except (OSError, ValueError) as e:  # the checkpoint's own check names the problem too
        raise DataError(
            f"--multimodal-keys: --hf-checkpoint {hf_checkpoint} has no readable config ({e})"
        ) from None
    if not is_vision(model_type):
        built = ", ".join(f.model_type for f in FAMILIES.values() if f.vision)
        raise DataError(
            f"--multimodal-keys: --hf-checkpoint {hf_checkpoint} is model_type {model_type!r}, which runs "
            f"as a text model here; images are built for {built} (docs/vlm.md)"
        )
    processor = load_processor(hf_checkpoint)
    if processor is None:
        raise DataError(
            f"--multimodal-keys: --hf-checkpoint {hf_checkpoint} has no image processor "
            "(preprocessor_config.json): is it a vision-language model?"
        )
    return processor


def vision_processor(config: Any) -> Any:
    """The checkpoint's processor when the job's prompt data or an evaluation set has
    --multimodal-keys; else None (text prompts need only the tokenizer). `config`: the JobConfig."""
    data = [config.rollout.data, *(d.data for d in config.eval.datasets)]
    if not any(d is not None and d.multimodal_keys for d in data):
        return None
    return checked_processor(config.train.hf_checkpoint)
