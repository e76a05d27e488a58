"""Images in the adapters' chat messages, for a vision-language model (the adapter was given the
checkpoint's processor).

OpenAI's image content parts (`{"type": "image_url", "image_url": {"url": ...}}`, a data URL, a
path or an http(s) URL; the Responses API's `input_image`) become chat-template image items
(`{"type": "image", "image": url}`) in place, beside the text parts, so the template writes the
model's placeholder where each image stood. The turn's images, in the order of the messages, go
to the engine as `image_data` with the prompt's ids (each placeholder expanded by the processor)
and are recorded with the turn, so its samples train with them. Without a processor (a text
model) images stay "[image omitted]" text (slime.agent.adapters.common.flatten_content).
"""

from __future__ import annotations

from typing import Any

from slime.agent.adapters.errors import AdapterError


def image_source(block: Any) -> str | None:
    """The URL of an OpenAI image content part; None for any other part."""
    if not isinstance(block, dict) or block.get("type") not in ("image_url", "input_image"):
        return None
    url = block.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    return url if isinstance(url, str) and url else None


def content_with_images(content: Any, flatten: Any) -> Any:
    """`content` as the chat template takes it: a list of text and image items where it holds an
    image part, else `flatten(content)` (the adapters' text)."""
    if not isinstance(content, list) or not any(image_source(b) is not None for b in content):
        return flatten(content)
    items: list[dict[str, Any]] = []
    for block in content:
        source = image_source(block)
        if source is not None:
            items.append({"type": "image", "image": source})
        elif text := flatten([block]):
            items.append({"type": "text", "text": text})
    return items


def image_items(messages: list[dict[str, Any]]) -> list[str]:
    """The image sources of chat-template messages, in order."""
    return [item["image"] for m in messages if isinstance(m.get("content"), list)
            for item in m["content"] if isinstance(item, dict) and item.get("type") == "image"]  # fmt: skip


def load_images(messages: list[dict[str, Any]]) -> list[Any]:
    """The messages' images decoded (RGB PIL), in order; 400 naming the one that cannot be read."""
    from slime.utils.processing_utils import ImageError, load_image

    out = []
    for i, source in enumerate(image_items(messages)):
        try:
            out.append(load_image(source))
        except ImageError as e:
            raise AdapterError(400, f"image {i} of the messages: {e}") from None
    return out
