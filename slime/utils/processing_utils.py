"""`slime.utils.processing_utils`: tokenizers, processors and images of vision-language models, at
the path slime's plugins import them from (`load_tokenizer`, `load_processor`,
`build_processor_kwargs`, `process_vision_info`, `encode_image_for_rollout_engine`), with the
image loading the data, the engine and the dumps share.

An image reaches us as a file path, a `data:image/...;base64,` URL, bare base64, an http(s) URL,
or a PIL image; `load_image` turns each into an RGB PIL image or raises `ImageError` naming the
source. A dump keeps images as uint8 tensors (`image_to_tensor`), which `torch.load(weights_only=True)`
reads, and gets the same pixels back (`tensor_to_image`). `prompt_images`, `image_train_inputs`
and `expanded_prompt_ids` are what the rollout, the SFT tool and the agent adapters need of a
prompt's images: the engine's `image_data`, the trainer's tensors, the ids with each image's tokens.

transformers builds a processor's video processor with torchvision only. Where torchvision is
not installed (the CPU install), `load_processor` builds the checkpoint's processor class without
one: images work, videos are refused by the processor itself.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import logging
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Qwen2-VL / Qwen2.5-VL patches are 14 pixels wide; Qwen3-VL's 16 (the processor's own
# patch_size wins when it has one).
DEFAULT_PATCH_SIZE = 14
URL_TIMEOUT_S = 30.0


class ImageError(ValueError):
    """An image that cannot be read: the message names its source."""


def load_tokenizer(name_or_path: str, **kwargs: Any) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name_or_path, **kwargs)


def load_processor(name_or_path: str, **kwargs: Any) -> Any:
    """The checkpoint's multimodal processor, or None for a text-only checkpoint."""
    from transformers import AutoConfig, AutoProcessor, PreTrainedTokenizerBase, ProcessorMixin

    try:
        processor = AutoProcessor.from_pretrained(name_or_path, **kwargs)
    except (OSError, ValueError, AttributeError, ImportError, TypeError) as e:
        logger.info("AutoProcessor cannot load %s (%s); trying the images-only processor", name_or_path, e)
        processor = None
    if isinstance(processor, ProcessorMixin) and not isinstance(processor, PreTrainedTokenizerBase):
        return processor
    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError):
        return None
    return _images_only_processor(name_or_path, config, **kwargs)


def _images_only_processor(name_or_path: str, config: Any, **kwargs: Any) -> Any:
    """The processor class transformers names for `config`, built from the checkpoint's image
    processor and tokenizer with no video processor (what needs torchvision); None when the
    checkpoint has no image processor."""
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES

    class_name = PROCESSOR_MAPPING_NAMES.get(config.model_type)
    if class_name is None or not os.path.exists(os.path.join(name_or_path, "preprocessor_config.json")):
        return None
    import transformers

    cls = getattr(transformers, class_name)
    image_processor = AutoImageProcessor.from_pretrained(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)

    # transformers reads a processor's parts from its __init__'s parameter names: without
    # `video_processor` there it neither asks for one nor checks its class.
    def __init__(
        self: Any,
        image_processor: Any = None,
        tokenizer: Any = None,
        chat_template: Any = None,
        **init_kwargs: Any,
    ) -> None:
        cls.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **init_kwargs)
        self.video_processor = None

    images_only = type(f"{cls.__name__}ImagesOnly", (cls,), {"__init__": __init__})
    return images_only(
        image_processor=image_processor,
        tokenizer=tokenizer,
        chat_template=getattr(tokenizer, "chat_template", None),
    )


def build_processor_kwargs(multimodal_inputs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments of `processor(text=..., **kwargs)`: the sample's images / videos, the
    text's ids as lists and the modalities' outputs as tensors (slime's convention)."""
    result = dict(multimodal_inputs) if multimodal_inputs else {}
    result["text_kwargs"] = {**result.get("text_kwargs", {}), "return_tensors": None}
    result["return_mm_token_type_ids"] = False
    for key in ("audio_kwargs", "images_kwargs", "videos_kwargs"):
        result[key] = {**result.get(key, {}), "return_tensors": "pt"}
    return result


def process_vision_info(prompt: Any, processor: Any) -> dict[str, Any]:
    """The images (and videos) of chat messages, in order: {"images": [PIL] or None, "videos": None}.

    Uses qwen_vl_utils where installed (the Qwen-VL family's own resizing rules); otherwise every
    content item of type "image" is loaded with `load_image`. Videos need qwen_vl_utils.
    """
    try:
        from qwen_vl_utils import process_vision_info as qwen_process_vision_info
    except ImportError:
        images = [load_image(item.get("image")) for item in _content_items(prompt, "image")]
        if _content_items(prompt, "video"):
            raise ImageError("video content needs qwen_vl_utils (pip install qwen-vl-utils)") from None
        return {"images": images or None, "videos": None}
    patch_size = (
        getattr(getattr(processor, "image_processor", None), "patch_size", None) or DEFAULT_PATCH_SIZE
    )
    images, videos = qwen_process_vision_info(prompt, image_patch_size=patch_size)
    return {"images": images, "videos": videos}


def _content_items(prompt: Any, kind: str) -> list[dict[str, Any]]:
    if not isinstance(prompt, list):
        return []
    return [
        item
        for message in prompt
        if isinstance(message, dict) and isinstance(message.get("content"), list)
        for item in message["content"]
        if isinstance(item, dict) and item.get("type") == kind
    ]


def encode_image_for_rollout_engine(image: Any) -> str:
    """An image as the engines take it in `image_data`: a PNG data URL of its RGB pixels."""
    image = load_image(image)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def load_image(source: Any) -> Any:
    """An RGB PIL image from a PIL image, encoded bytes, a path, a data URL, base64 text or an
    http(s) URL; or from a dict item: Qwen-VL's message item {"image": ...} (or {"url": ...}), or
    the Hugging Face datasets' image record {"bytes": ..., "path": ...} (parquet's image columns)."""
    from PIL import Image

    if isinstance(source, dict):
        keys = sorted(source)
        source = next(
            (source[k] for k in ("image", "bytes", "url", "path") if source.get(k) is not None), None
        )
        if source is None:
            raise ImageError(f"an image item needs one of 'image', 'bytes', 'url' or 'path'; it has {keys}")
    if isinstance(source, Image.Image):
        return source if source.mode == "RGB" else source.convert("RGB")
    if isinstance(source, bytes | bytearray | memoryview):
        return _decode(bytes(source), f"of {len(source)} bytes")
    if not isinstance(source, str) or not source:
        raise ImageError(
            f"an image must be a path, bytes, a data URL, base64 text or a URL, not {type(source).__name__}"
        )
    what = _describe(source)
    if source.startswith(("http://", "https://")):
        return _decode(_fetch(source), what)
    if source.startswith("data:"):
        try:
            return _decode(base64.b64decode(source.split(",", 1)[1], validate=True), what)
        except (binascii.Error, IndexError):
            raise ImageError(f"image {what}: not valid base64 after 'data:...,'") from None
    if os.path.isfile(source):
        try:
            with open(source, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ImageError(f"image file {what} cannot be read ({e.strerror})") from None
        return _decode(data, f"file {what}")
    try:  # not a file: base64, or a path that does not exist
        data = base64.b64decode(source, validate=True)
    except binascii.Error:
        raise ImageError(f"image file {what} does not exist") from None
    try:
        return _decode(data, what)
    except ImageError:
        raise ImageError(f"image {what}: no such file, and not base64 of an image") from None


def _decode(data: bytes, what: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")
    except Image.DecompressionBombError as e:
        raise ImageError(f"image {what} is too large to decode ({e})") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ImageError(f"image {what} cannot be decoded ({e})") from None


def _describe(source: str) -> str:
    """A path or URL as it is; inline data (a data URL, base64) cut short."""
    inline = source.startswith("data:") or len(source) > 1024
    return repr(source[:60] + f"... ({len(source)} characters)" if inline and len(source) > 80 else source)


def _fetch(url: str) -> bytes:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=URL_TIMEOUT_S) as response:
            return bytes(response.read())
    # every way a URL fails (unreachable, malformed: http.client's InvalidURL, a bad IPv6 host, a
    # truncated body) is the image's problem, one message
    except (urllib.error.URLError, TimeoutError, OSError, ValueError, http.client.HTTPException) as e:
        raise ImageError(
            f"image URL {url!r} cannot be fetched ({e}); with no network, download it and give its "
            "path or base64 instead"
        ) from None


def image_to_tensor(image: Any) -> Any:
    """An image's RGB pixels as a uint8 tensor [height, width, 3] (what a dump keeps)."""
    import numpy as np
    import torch

    return torch.from_numpy(np.array(load_image(image), dtype=np.uint8, copy=True))


def tensor_to_image(pixels: Any) -> Any:
    """The PIL image of `image_to_tensor`'s tensor."""
    from PIL import Image

    return Image.fromarray(pixels.numpy())


@dataclass(frozen=True)
class PromptImages:
    """A prompt's images as generation sends and trains them."""

    image_data: list[str]
    """PNG data URLs, the engine request's `image_data`."""
    train_inputs: dict[str, Any]
    """The processor's tensors: `pixel_values`, `image_grid_thw`."""


def image_train_inputs(processor: Any, images: list[Any]) -> dict[str, Any]:
    """The image processor's tensors of `images`, in order: what the trainer's forward takes
    (`Sample.multimodal_train_inputs`)."""
    out = processor.image_processor(images=list(images), return_tensors="pt")
    return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}


def prompt_images(processor: Any, images: list[Any]) -> PromptImages:
    """What generation needs of a prompt's images (one call per prompt group: the PNG encoding and
    the image processor are the costly part)."""
    return PromptImages(
        [encode_image_for_rollout_engine(image) for image in images], image_train_inputs(processor, images)
    )


def expanded_prompt_ids(processor: Any, text: str, images: list[Any]) -> list[int]:
    """The prompt's token ids with each image placeholder expanded to its image's tokens (what the
    engine and the trainer see)."""
    out = processor(text=[text], images=list(images), return_tensors="pt", add_special_tokens=False)
    return [int(t) for t in out["input_ids"][0]]
