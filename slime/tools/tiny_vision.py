"""The vision-language side of `make_tiny_model --arch qwen3_vl | qwen3_5_vl | qwen3_5_moe_vl`:
transformers' own Qwen3-VL and Qwen3.5 classes at a tiny size, with the files a released
checkpoint carries for its processor.

- qwen3_vl is `Qwen3VLForConditionalGeneration`: a vision tower (16-pixel patches, 2 frames per
  temporal patch, 2 x 2 patches merged into one language-model token, learned position
  embeddings, DeepStack features added to the first decoder layer) and a Qwen3 language model
  with interleaved multimodal rotary positions (mrope_section split like Qwen3-VL's 24/20/20).
- qwen3_5_vl / qwen3_5_moe_vl are `Qwen3_5ForConditionalGeneration` /
  `Qwen3_5MoeForConditionalGeneration`, what Qwen3.5's released checkpoints are (model_type
  `qwen3_5` / `qwen3_5_moe`): the same kind of vision tower without DeepStack, before the tiny
  qwen3_5 / qwen3_5_moe text model (gated delta-net and gated attention layers, a quarter of the
  head dim rotated), its rotary frequencies split like Qwen3.5's 11/11/10.
- The tokenizer is make_tiny_model's character-level one plus Qwen-VL's vision markers
  (`<|vision_start|>`, `<|vision_end|>`, `<|image_pad|>`, `<|video_pad|>`), ids after the
  others, so a text model's ids are unchanged.
- `preprocessor_config.json` is Qwen2-VL's image processor (the one Qwen3-VL uses) with small
  pixel bounds: a 64 x 64 image is 16 patches, 4 language-model tokens.
- The chat template renders an image content item as `<|vision_start|><|image_pad|><|vision_end|>`
  where it stands in the message, as Qwen-VL's templates do.
"""

from __future__ import annotations

import argparse
from typing import Any

VISION_FAMILIES = ("qwen3_vl", "qwen3_5_vl", "qwen3_5_moe_vl")
TEXT_ARCH = {"qwen3_5_vl": "qwen3_5", "qwen3_5_moe_vl": "qwen3_5_moe"}
"""The Qwen3.5 archs' language models: tiny_families' text archs."""
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
PATCH_SIZE = 16
MERGE_SIZE = 2
MIN_PIXELS = 32 * 32
MAX_PIXELS = 256 * 256


def vision_chat_template(text_template: str) -> str:
    """make_tiny_model's template with content lists rendered: text items as their text, image and
    video items as Qwen-VL's vision markers."""
    plain = "{%- set ns.content = message.content if message.content is string else '' -%}"
    assert plain in text_template, "make_tiny_model's chat template changed: update vision_chat_template"
    parts = (
        "{%- if message.content is string -%}{%- set ns.content = message.content -%}"
        "{%- else -%}{%- set ns.content = '' -%}"
        "{%- for item in message.content -%}"
        "{%- if item.type == 'image' or item.image is defined or item.type == 'image_url' -%}"
        "{%- set ns.content = ns.content + '<|vision_start|><|image_pad|><|vision_end|>' -%}"
        "{%- elif item.type == 'video' or item.video is defined -%}"
        "{%- set ns.content = ns.content + '<|vision_start|><|video_pad|><|vision_end|>' -%}"
        "{%- elif item.text is defined -%}{%- set ns.content = ns.content + item.text -%}"
        "{%- endif -%}{%- endfor -%}{%- endif -%}"
    )
    return text_template.replace(plain, parts)


def add_vision_tokens(tokenizer: Any, text_template: str) -> dict[str, int]:
    """Add the vision markers as special tokens and the vision chat template; their ids."""
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = vision_chat_template(text_template)
    return {token: tokenizer.convert_tokens_to_ids(token) for token in VISION_TOKENS}


def mrope_section(frequencies: int) -> list[int]:
    """Qwen3.5's split of the rotary frequencies, interleaved t, h, w, t, h, w, ...: index i goes
    to height when i % 3 == 1, to width when i % 3 == 2 (32 frequencies: 11 / 11 / 10, as released)."""
    height, width = (frequencies + 1) // 3, frequencies // 3
    return [frequencies - height - width, height, width]


def vision_config(args: argparse.Namespace, common: dict[str, Any], token_ids: dict[str, int]) -> Any:
    """The vision-language config: `common` (make_tiny_model's size fields) for the language model,
    a vision tower of --vision-depth blocks of --vision-hidden-size."""
    from transformers import Qwen3VLConfig

    head_dim = args.hidden_size // args.num_heads
    if args.arch in TEXT_ARCH:
        return _qwen3_5_config(args, common, token_ids, head_dim)
    half = head_dim // 2
    spatial = half * 5 // 16  # Qwen3-VL splits 64 rotary frequencies 24 / 20 / 20 (t / h / w)
    text = {key: value for key, value in common.items() if key not in ("torch_dtype", "bos_token_id")}
    text.update(
        head_dim=head_dim,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [half - 2 * spatial, spatial, spatial],
            "mrope_interleaved": True,
        },
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config={**_tower(args), "deepstack_visual_indexes": [0]},
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=common["tie_word_embeddings"],
    )


def _qwen3_5_config(
    args: argparse.Namespace, common: dict[str, Any], token_ids: dict[str, int], head_dim: int
) -> Any:
    """Qwen3.5's vision-language config around tiny_families' text model of the same name."""
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig

    from slime.tools.tiny_families import family_config

    text = family_config(args, common, TEXT_ARCH[args.arch])
    rope = dict(text.rope_parameters)
    rope.update(
        mrope_section=mrope_section(int(head_dim * rope["partial_rotary_factor"]) // 2),
        mrope_interleaved=True,
    )
    text.rope_parameters = rope
    config_class = Qwen3_5MoeConfig if args.arch == "qwen3_5_moe_vl" else Qwen3_5Config
    return config_class(
        text_config=text.to_dict(),
        vision_config=_tower(args),
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )


def _tower(args: argparse.Namespace) -> dict[str, Any]:
    """The vision tower's fields (--vision-depth blocks of --vision-hidden-size)."""
    return dict(
        depth=args.vision_depth,
        hidden_size=args.vision_hidden_size,
        intermediate_size=args.vision_hidden_size * 2,
        num_heads=max(1, args.vision_hidden_size // 32),
        patch_size=PATCH_SIZE,
        spatial_merge_size=MERGE_SIZE,
        temporal_patch_size=2,
        out_hidden_size=args.hidden_size,
        num_position_embeddings=64,  # an 8 x 8 grid of learned positions, interpolated per image
    )


def scale_vision_tower(model: Any, seed: int) -> None:
    """Draw the vision tower's matrices with std 1 / sqrt(fan-in). At transformers' own init (std
    0.02) a tiny tower's merger passes almost nothing of the image on (two different images give
    features equal to within 3%), so a model could not learn to see; a trained tower's features
    do depend on the image."""
    import math

    import torch

    g = torch.Generator().manual_seed(seed + 11)
    with torch.no_grad():
        for name, param in model.model.visual.named_parameters():
            if param.dim() >= 2 and "pos_embed" not in name:
                param.copy_(torch.randn(param.shape, generator=g) / math.sqrt(param[0].numel()))


def save_image_processor(path: Any) -> None:
    """Qwen2-VL's image processor (PIL backend: no torchvision needed) with the tiny bounds."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH_SIZE,
        temporal_patch_size=2,
        merge_size=MERGE_SIZE,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    )
    processor.save_pretrained(path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vision-depth", type=int, default=2, help="vision-language archs: vision transformer blocks"
    )
    parser.add_argument(
        "--vision-hidden-size", type=int, default=64, help="vision-language archs: vision tower width"
    )


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.arch not in VISION_FAMILIES:
        return
    if args.vision_depth <= 0 or args.vision_hidden_size <= 0:
        parser.error("--vision-depth and --vision-hidden-size must be positive")
    head_dim = args.hidden_size // args.num_heads
    if args.arch in TEXT_ARCH and (head_dim < 24 or head_dim % 8):
        parser.error(
            f"--arch {args.arch}: the head dim (--hidden-size / --num-heads = {head_dim}) must be a multiple "
            "of 8 and at least 24: a quarter of it is rotated, in pairs, and its rotary frequencies split "
            "three ways (time, height, width)"
        )
    if head_dim % 4:
        parser.error(
            f"--arch {args.arch}: the head dim ({head_dim}) must be a multiple "
            "of 4 (its rotary frequencies split three ways)"
        )
