"""Images in the adapters' chat messages, for a vision-language model (the adapter was given the
checkpoint's processor).

OpenAI's image content parts (`{"type": "image_url", "image_url": {"url": ...}}`, a data URL, a
path or an http(s) URL; the Responses API's `input_image`) and Anthropic's image blocks
(`{"type": "image", "source": {"type": "base64", "media_type": ..., "data": ...}}` or a `url`
source) become chat-template image items
(`{"type": "image", "image": url}`) in place, beside the text parts, so the template writes the
model's placeholder where each image stood. The turn's images, in the order of the messages, go
to the engine as `image_data` with the prompt's ids (each placeholder expanded by the processor)
and are recorded with the turn, so its samples train with them. Without a processor (a text
model) images stay "[image omitted]" text (slime.agent.adapters.messages.flatten_content).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime.agent.adapters.errors import AdapterError


def image_source(block: Any) -> str | None:
    """The URL of an OpenAI image content part or an Anthropic image block (its base64 data as a
    data URL); None for any other part. An Anthropic source of another kind (a Files API id) is
    refused: the adapter has no files to read it from."""
    if not isinstance(block, dict):
        return None
    if block.get("type") == "image":
        return _anthropic_source(block.get("source"))
    if block.get("type") not in ("image_url", "input_image"):
        return None
    url = block.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    return url if isinstance(url, str) and url else None


def _anthropic_source(source: Any) -> str:
    """An Anthropic image block's source as a URL (base64 data as a data URL); 400 for any other."""
    if not isinstance(source, dict):
        raise AdapterError(
            400,
            "an image block needs a 'source': {'type': 'base64', 'media_type': ..., 'data': ...} "
            "or {'type': 'url', 'url': ...}",
        )
    kind = source.get("type")
    if kind == "base64" and isinstance(source.get("data"), str) and source["data"]:
        return f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    if kind == "url" and isinstance(source.get("url"), str) and source["url"]:
        return source["url"]
    if kind in ("base64", "url"):
        field = "data" if kind == "base64" else "url"
        raise AdapterError(400, f"an image block's {kind} source needs its {field!r} as a non-empty string")
    raise AdapterError(
        400,
        f"an image block's source of type {kind!r}: give base64 data or a url (the adapter "
        "reads no Files API ids)",
    )


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
    return [
        item["image"]
        for m in messages
        if isinstance(m.get("content"), list)
        for item in m["content"]
        if isinstance(item, dict) and item.get("type") == "image"
    ]


@dataclass
class SessionImage:
    """One image of a session, decoded and processed once (every later turn that repeats it takes
    these, so a turn's cost and a session's memory grow with its images, not its turns)."""

    image: Any
    """RGB PIL."""
    url: str
    """The PNG data URL the engine gets (it never fetches anything itself)."""
    inputs: dict[str, Any]
    """The processor's `pixel_values` and `image_grid_thw` of this image alone."""
    num_tokens: int
    token_id: int


def session_images(
    cache: dict[str, SessionImage], messages: list[dict[str, Any]], processor: Any
) -> list[SessionImage]:
    """The messages' images in order, from `cache` (by source) or decoded, processed and cached.
    A client may send data URLs and http(s) URLs, not the adapter host's paths; 400 naming the image
    that cannot be read. Blocking (decoding, fetching): call it off the event loop."""
    from slime.utils.processing_utils import ImageError, load_image, prompt_images

    out = []
    for i, source in enumerate(image_items(messages)):
        if source not in cache:
            if not source.startswith(("data:", "http://", "https://")):
                raise AdapterError(
                    400,
                    f"image {i} of the messages: give a data URL or an http(s) URL (the adapter "
                    "does not read paths on its host)",
                )
            try:
                image = load_image(source)
                processed = prompt_images(processor, [image])
            except (ImageError, ValueError) as e:
                raise AdapterError(400, f"image {i} of the messages: {e}") from None
            grid = processed.train_inputs["image_grid_thw"]
            cache[source] = SessionImage(
                image,
                processed.image_data[0],
                processed.train_inputs,
                int(grid.prod()) // int(processor.image_processor.merge_size) ** 2,
                int(processor.tokenizer.convert_tokens_to_ids(processor.image_token)),
            )
        out.append(cache[source])
    return out
