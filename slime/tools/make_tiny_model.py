"""Write a small Hugging Face causal-LM checkpoint, built locally with no network.

    python -m slime.tools.make_tiny_model --out DIR [--arch ARCH] [--hidden-size 256]
        [--num-layers 4] [--num-heads 4] [--num-kv-heads 2] [--head-dim N] [--vocab N]
        [--rope-theta T] [--dtype float32] [--seed 0]
        [--num-experts 4 --num-experts-per-tok 2 --moe-intermediate-size N]   (mixture of experts)
        [--mtp-layers N]   (multi-token prediction modules: glm4_moe, deepseek_v3, glm4_moe_lite)

ARCH is transformers' model_type: qwen3 (default), qwen2, qwen3_moe, the families in
slime.tools.tiny_families: glm4, glm4_moe, deepseek_v3, glm4_moe_lite, qwen3_next, qwen3_5,
qwen3_5_moe, and the vision-language qwen3_vl, qwen3_5_vl and qwen3_5_moe_vl (Qwen3.5 as released:
model_type qwen3_5 / qwen3_5_moe; slime.tools.tiny_vision: a vision tower, an image processor and a
chat template with images; [--vision-depth 2] [--vision-hidden-size 64]).

`qwen3_moe` is Hugging Face's Qwen3MoeForCausalLM (Qwen3-30B-A3B's architecture): every layer's
MLP is a router over `--num-experts` experts, `--num-experts-per-tok` of them per token, their
weights renormalised (norm_topk_prob, as Qwen3-MoE's checkpoints set it); the checkpoint stores
one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, ...), the hub's layout.

`--preset qwen3-0.6b | qwen2.5-0.5b | qwen3-1.7b` takes a released model's shape (its config.json:
arch, vocabulary, widths, layers, heads, head dim, rope theta, bfloat16) with random weights; a
flag given beside it overrides the preset (`--preset qwen3-0.6b --num-layers 2`). The vocabulary
keeps its published 151936 rows, of which the tokenizer below uses the first ids.

The directory holds config.json, model.safetensors, generation_config.json and tokenizer files
that `AutoTokenizer.from_pretrained(DIR)` loads offline. The tokenizer is character level over
printable ASCII (digits, arithmetic signs, letters, space, newline) plus Qwen-style chat markers,
so every demo prompt and answer tokenizes one character per token. The same arguments and seed
give the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from slime.tools import tiny_vision
from slime.tools.tiny_families import (
    MOE_FAMILIES,
    MTP_FAMILIES,
    NEW_FAMILIES,
    family_config,
    mtp_tensors,
    seed_family_state,
)
from slime.utils.files import staged_directory

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = [PAD_TOKEN, IM_START, IM_END, UNK_TOKEN]

# Qwen-style template: the same shape the real Qwen chat models use, so prompts built for the
# demo look like the ones users build for real checkpoints. With tools (the agent adapters), a
# compact line names them in the system message (`tools: python(code)`: every character is a
# token here) and an assistant's tool calls follow its content as Hermes / Qwen
# `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; a tool's result is a message
# of role `tool`. Without tools the rendering is the plain one.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(tools='') -%}"
    "{%- if tools -%}"
    "{%- for t in tools -%}{%- set f = t.function if t.function is defined else t -%}"
    "{%- set ns.tools = ns.tools + (' ' if ns.tools else 'tools: ') + f.name + '('"
    " + ((f.parameters.properties if f.parameters is defined and f.parameters.properties is defined else {})"
    " | list | join(',')) + ')' -%}"
    "{%- endfor -%}"
    "{%- if messages[0].role != 'system' -%}"
    "{{ '<|im_start|>system\n' + ns.tools + '<|im_end|>\n' }}{%- endif -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set ns.content = message.content if message.content is string else '' -%}"
    "{%- if loop.first and message.role == 'system' and ns.tools -%}"
    "{%- set ns.content = ns.content + '\n' + ns.tools -%}{%- endif -%}"
    "{%- if message.role == 'assistant' and message.tool_calls is defined and message.tool_calls -%}"
    "{%- for call in message.tool_calls -%}"
    "{%- set f = call.function if call.function is defined else call -%}"
    "{%- set ns.content = ns.content + '<tool_call>' + ({'name': f.name, 'arguments': f.arguments} | tojson)"
    " + '</tool_call>' -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_start|>' + message.role + '\n' + ns.content + '<|im_end|>' + '\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)


# Released shapes, from each model's config.json on the Hugging Face hub. Tied embeddings and
# rms_norm_eps 1e-6 are this tool's fixed values for qwen2 / qwen3, and these models' too; Qwen2's
# head dim is hidden / heads (its config has no head_dim).
# fmt: off
PRESET_FLAGS = ("arch", "vocab", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim", "max_position_embeddings", "rope_theta", "dtype")
PRESETS: dict[str, dict[str, object]] = {name: dict(zip(PRESET_FLAGS, row)) for name, row in {
    #                arch     vocab   hidden  inter  layers heads kv  head_dim  max_pos rope_theta dtype
    "qwen3-0.6b":   ("qwen3", 151936, 1024,   3072,  28,    16,   8,  128,      40960,  1e6,      "bfloat16"),
    "qwen2.5-0.5b": ("qwen2", 151936, 896,    4864,  24,    14,   2,  None,     32768,  1e6,      "bfloat16"),
    "qwen3-1.7b":   ("qwen3", 151936, 2048,   6144,  28,    16,   8,  128,      40960,  1e6,      "bfloat16"),
}.items()}
# fmt: on


def tokenizer_alphabet() -> list[str]:
    """Printable ASCII plus newline and tab, in a fixed order."""
    return ["\n", "\t"] + [chr(c) for c in range(32, 127)]


def build_tokenizer():
    """A character-level fast tokenizer (BPE with no merges) with Qwen chat markers."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {}
    for token in SPECIAL_TOKENS + tokenizer_alphabet():
        vocab[token] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK_TOKEN))
    core.decoder = decoders.Fuse()
    core.add_special_tokens(SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_config(
    args: argparse.Namespace, vocab_size: int, tokenizer, vision_ids: dict[str, int] | None = None
):
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    common = dict(
        vocab_size=vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size or _default_intermediate(args.hidden_size),
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        torch_dtype=args.dtype,
    )
    if args.arch in NEW_FAMILIES:
        return family_config(args, common)
    if vision_ids is not None:
        return tiny_vision.vision_config(args, common, vision_ids)
    head_dim = args.head_dim or args.hidden_size // args.num_heads
    if args.rope_theta is not None:
        common["rope_parameters"] = {"rope_type": "default", "rope_theta": args.rope_theta}
    if args.arch == "qwen3":
        return Qwen3Config(head_dim=head_dim, **common)
    if args.arch == "qwen3_moe":
        config = Qwen3MoeConfig(
            num_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=args.moe_intermediate_size or args.hidden_size // 2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **common,
        )
        # Not a declared field of transformers' Qwen3MoeConfig, but Qwen3-MoE checkpoints carry it
        # (config.json) and the model reads it.
        config.head_dim = head_dim
        return config
    return Qwen2Config(**common)


def _default_intermediate(hidden_size: int) -> int:
    # Qwen's ratio is ~2.7x hidden; round to a multiple of 16 for tidy matmuls.
    return int(hidden_size * 8 / 3 + 15) // 16 * 16


# The archs whose rope theta and head dim the flags set (the other families set their own); Qwen2's
# config has no head_dim (its head dim is hidden / heads).
FLAG_ARCHS = {"rope_theta": ("qwen3", "qwen2", "qwen3_moe"), "head_dim": ("qwen3", "qwen3_moe")}


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser, tokenizer_size: int) -> None:
    """Exit 2 naming the flag (torch is imported only after these checks pass)."""
    for flag in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "max_position_embeddings"):
        if getattr(args, flag) <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    for flag, archs in FLAG_ARCHS.items():
        value = getattr(args, flag)
        if value is not None and args.arch not in archs:
            parser.error(f"--{flag.replace('_', '-')} applies to --arch {', '.join(archs)}")
        if value is not None and value <= 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    if args.head_dim is None and args.hidden_size % args.num_heads:
        parser.error(f"--hidden-size {args.hidden_size} must be divisible by --num-heads {args.num_heads}")
    if args.num_heads % args.num_kv_heads:
        parser.error(f"--num-heads {args.num_heads} must be divisible by --num-kv-heads {args.num_kv_heads}")
    moe = {
        "num_experts": args.num_experts,
        "num_experts_per_tok": args.num_experts_per_tok,
        "moe_intermediate_size": args.moe_intermediate_size,
    }
    if tiny_vision.TEXT_ARCH.get(args.arch, args.arch) not in MOE_FAMILIES:
        given = [name for name, value in moe.items() if value is not None]
        if given:
            parser.error(
                f"--{given[0].replace('_', '-')} applies to the mixture-of-experts archs only "
                f"(--arch {', '.join(MOE_FAMILIES)}, qwen3_5_moe_vl)"
            )
    else:
        args.num_experts = args.num_experts or 4
        args.num_experts_per_tok = args.num_experts_per_tok or 2
        if args.num_experts < 2:
            parser.error("--num-experts must be at least 2")
        if not 1 <= args.num_experts_per_tok <= args.num_experts:
            parser.error(f"--num-experts-per-tok must be between 1 and --num-experts ({args.num_experts})")
        if args.moe_intermediate_size is not None and args.moe_intermediate_size <= 0:
            parser.error("--moe-intermediate-size must be positive")
    if args.mtp_layers:
        if args.mtp_layers < 0:
            parser.error("--mtp-layers must be >= 0")
        if args.arch not in MTP_FAMILIES:
            parser.error(
                f"--mtp-layers applies to --arch {', '.join(MTP_FAMILIES)} (the families whose checkpoints "
                "carry multi-token prediction modules)"
            )
    if args.vocab is not None and args.vocab < tokenizer_size:
        parser.error(
            f"--vocab {args.vocab} is smaller than the tokenizer ({tokenizer_size} tokens); "
            f"use --vocab {tokenizer_size} or more"
        )


def make_tiny_model(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Path:
    tokenizer = build_tokenizer()
    vision = args.arch in tiny_vision.VISION_FAMILIES
    vision_ids = tiny_vision.add_vision_tokens(tokenizer, CHAT_TEMPLATE) if vision else None
    validate(args, parser, len(tokenizer))
    tiny_vision.validate(args, parser)
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig

    vocab_size = args.vocab if args.vocab is not None else len(tokenizer)
    config = build_config(args, vocab_size, tokenizer, vision_ids)

    torch.manual_seed(args.seed)
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    model.eval()
    seed_family_state(model, args.seed)
    if vision:
        tiny_vision.scale_vision_tower(model, args.seed)
    mtp = mtp_tensors(model, args.mtp_layers, args.seed) if args.mtp_layers else {}
    # Built and seeded in float32 whatever --dtype says, so a bfloat16 checkpoint holds the float32
    # one's weights rounded.
    dtype = getattr(torch, args.dtype)
    model.to(dtype)
    generation_config = GenerationConfig(
        eos_token_id=[config.get_text_config().eos_token_id, config.get_text_config().pad_token_id],
        pad_token_id=config.get_text_config().pad_token_id,
        do_sample=True,
        temperature=1.0,
    )

    out = Path(args.out)
    # Written into a sibling directory and renamed, so a crash never leaves a half-written checkpoint.
    with staged_directory(str(out)) as staging_dir:
        staging = Path(staging_dir)
        model.save_pretrained(staging, safe_serialization=True)
        if mtp:  # transformers has no MTP modules: their tensors join the file
            from safetensors.torch import load_file, save_file

            weights = staging / "model.safetensors"
            mtp = {name: tensor.to(dtype) for name, tensor in mtp.items()}
            save_file({**load_file(weights), **mtp}, weights, metadata={"format": "pt"})
        generation_config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if vision:
            tiny_vision.save_image_processor(staging)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m slime.tools.make_tiny_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", required=True, help="output checkpoint directory (replaced if it exists)")
    parser.add_argument(
        "--preset",
        choices=list(PRESETS),
        default=None,
        help="a released model's shape with random weights (the flags it sets default to its "
        "values; a flag given overrides). Weights are built in float32 first: qwen3-1.7b "
        "peaks at ~8 GB of memory",
    )
    _shape_flags(parser.add_argument_group("shape"))
    _moe_flags(parser.add_argument_group("mixture of experts"))
    tiny_vision.add_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def _shape_flags(g: Any) -> None:
    g.add_argument(
        "--arch",
        choices=["qwen3", "qwen2", "qwen3_moe", *NEW_FAMILIES, *tiny_vision.VISION_FAMILIES],
        default="qwen3",
    )
    g.add_argument("--hidden-size", type=int, default=256)
    g.add_argument("--intermediate-size", type=int, default=None, help="default: ~8/3 x hidden size")
    g.add_argument("--num-layers", type=int, default=4)
    g.add_argument("--num-heads", type=int, default=4)
    g.add_argument("--num-kv-heads", type=int, default=2)
    g.add_argument(
        "--head-dim",
        type=int,
        default=None,
        help="qwen3, qwen3_moe: each head's width (default: hidden size / heads)",
    )
    g.add_argument(
        "--vocab",
        type=int,
        default=None,
        help="embedding rows; default: the tokenizer size. Larger values pad the vocabulary",
    )
    g.add_argument("--max-position-embeddings", type=int, default=2048)
    g.add_argument(
        "--rope-theta",
        type=float,
        default=None,
        help="qwen3, qwen2, qwen3_moe: the rotary base (default: transformers' 10000)",
    )
    g.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="dtype of the saved weights (built in float32, then cast)",
    )


def _moe_flags(g: Any) -> None:
    g.add_argument("--num-experts", type=int, default=None, help="MoE archs: experts per layer (default 4)")
    g.add_argument(
        "--num-experts-per-tok",
        type=int,
        default=None,
        help="MoE archs: experts each token is routed to (default 2)",
    )
    g.add_argument(
        "--moe-intermediate-size",
        type=int,
        default=None,
        help="MoE archs: each expert's MLP width (default: half the hidden size)",
    )
    g.add_argument(
        "--mtp-layers",
        type=int,
        default=0,
        help="multi-token prediction modules after the decoder (num_nextn_predict_layers; "
        "glm4_moe, deepseek_v3, glm4_moe_lite)",
    )


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, argparse.ArgumentParser]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.preset is not None:
        # The preset's values become the defaults, so a flag given on the command line still wins.
        preset = PRESETS[args.preset]
        parser.set_defaults(**preset)
        args = parser.parse_args(argv)
        if args.arch != preset["arch"]:
            parser.error(
                f"--preset {args.preset} is --arch {preset['arch']}, not --arch {args.arch}: "
                "drop one of the two flags"
            )
    return args, parser


def main(argv: list[str] | None = None) -> int:
    args, parser = parse_args(argv)
    out = make_tiny_model(args, parser)
    with open(out / "config.json") as f:
        config = json.load(f)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        num_params = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    sys.stdout.write(
        json.dumps(
            {
                "out": str(out),
                "model_type": config["model_type"],
                "num_parameters": num_params,
                "vocab_size": config.get("vocab_size", config.get("text_config", {}).get("vocab_size")),
            }
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
