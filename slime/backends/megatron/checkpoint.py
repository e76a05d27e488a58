"""Megatron checkpoints on disk (Megatron-LM's torch layout), and HF checkpoints in and out.

    DIR/latest_checkpointed_iteration.txt          "release" (converted) or the iteration number
    DIR/release/mp_rank_{tp:02d}/model_optim_rng.pt            PP = 1
    DIR/release/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   PP > 1
        {"model": state dict, "checkpoint_version": 3.0, "iteration": int, "args": {...}}

`args` is a plain dict (loadable with `torch.load(weights_only=True)`) with Megatron's argument
names for the model shape and layout (tensor_model_parallel_size, pipeline_model_parallel_size,
num_layers, hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups, kv_channels,
padded_vocab_size, make_vocab_size_divisible_by, untie_embeddings_and_output_weights, ...) and
`slime_layout` (slime.backends.megatron.convert.Layout). A directory is written under a temporary
name and renamed when complete; an existing non-empty target is refused.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
from typing import Any

import torch

from slime.backends.megatron.convert import ConversionError, Layout, State

TRACKER = "latest_checkpointed_iteration.txt"
HF_SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")  # fmt: skip


def megatron_args(layout: Layout, tp: int, pp: int) -> dict[str, Any]:
    return {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "num_layers": layout.num_layers,
        "hidden_size": layout.hidden_size,
        "ffn_hidden_size": layout.ffn_hidden_size,
        "num_attention_heads": layout.num_heads,
        "group_query_attention": layout.num_query_groups != layout.num_heads,
        "num_query_groups": layout.num_query_groups,
        "kv_channels": layout.head_dim,
        "padded_vocab_size": layout.padded_vocab_size(tp),
        "make_vocab_size_divisible_by": layout.make_vocab_size_divisible_by,
        "untie_embeddings_and_output_weights": not layout.tied_embeddings,
        "add_qkv_bias": layout.qkv_bias,
        "qk_layernorm": layout.qk_norm,
        "swiglu": True,
        "normalization": "RMSNorm",
        "slime_layout": dict(layout.__dict__),
    }


def rank_dir(tp_rank: int, pp_stage: int, pp: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_stage:03d}"


def check_target(save_dir: str, flag: str = "--save-dir") -> None:
    """A target must not hold anything yet (nothing is overwritten)."""
    if os.path.exists(save_dir) and (not os.path.isdir(save_dir) or os.listdir(save_dir)):
        raise ConversionError(f"{flag} {save_dir!r} already exists and is not empty: choose a new directory")


def _publish(partial: str, final: str) -> None:
    if os.path.isdir(final):  # empty (checked before): replaced by the complete one
        os.rmdir(final)
    os.replace(partial, final)


def save_megatron(
    parts: dict[tuple[int, int], State], layout: Layout, save_dir: str, iteration: str = "release"
) -> None:
    tp = 1 + max(r for r, _ in parts)
    pp = 1 + max(s for _, s in parts)
    check_target(save_dir)
    final = os.path.abspath(save_dir)
    partial = final + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    args = megatron_args(layout, tp, pp)
    for (r, s), state in sorted(parts.items()):
        folder = os.path.join(partial, iteration, rank_dir(r, s, pp))
        os.makedirs(folder)
        torch.save({"model": {k: v.contiguous() for k, v in state.items()}, "checkpoint_version": 3.0,
                    "iteration": 0 if iteration == "release" else int(iteration), "args": args},
                   os.path.join(folder, "model_optim_rng.pt"))  # fmt: skip
    with open(os.path.join(partial, TRACKER), "w") as f:
        f.write(iteration + "\n")
    _publish(partial, final)


def load_megatron(load_dir: str) -> tuple[dict[tuple[int, int], State], dict[str, Any]]:
    """Every (tp rank, pp stage) state dict of the tracked iteration, and the stored args."""
    tracker = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(tracker):
        raise ConversionError(
            f"--load-dir {load_dir!r} has no {TRACKER}: not a Megatron checkpoint directory"
        )
    with open(tracker) as f:
        iteration = f.read().strip()
    folder = os.path.join(load_dir, iteration if iteration == "release" else f"iter_{int(iteration):07d}")
    parts: dict[tuple[int, int], State] = {}
    args: dict[str, Any] = {}
    for path in sorted(glob.glob(os.path.join(folder, "mp_rank_*", "model_optim_rng.pt"))):
        m = re.search(r"mp_rank_(\d+)(?:_(\d+))?$", os.path.dirname(path))
        assert m is not None
        blob = torch.load(path, map_location="cpu", weights_only=True)
        parts[(int(m.group(1)), int(m.group(2) or 0))] = blob["model"]
        args = blob.get("args") or {}
    if not parts:
        raise ConversionError(f"--load-dir {load_dir!r}: no mp_rank_*/model_optim_rng.pt under {folder}")
    return parts, args


def stored_layout(args: dict[str, Any], load_dir: str) -> Layout:
    if "slime_layout" not in args:
        raise ConversionError(
            f"--load-dir {load_dir!r}: the checkpoint's args carry no slime_layout (not written by slime)"
        )
    return Layout(**args["slime_layout"])


def load_hf_state(hf_dir: str) -> State:
    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not files:
        raise ConversionError(f"--hf-checkpoint {hf_dir!r} holds no *.safetensors weights")
    state: State = {}
    for path in files:
        state.update(load_file(path))
    return state


def save_hf(state: State, config_dir: str, save_dir: str, shard_bytes: int = 2 << 30) -> None:
    """safetensors (sharded past `shard_bytes`, with an index) plus config and tokenizer files
    copied from `config_dir`; written under a temporary name and renamed."""
    from safetensors.torch import save_file

    check_target(save_dir)
    final = os.path.abspath(save_dir)
    partial = final + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(partial, "model.safetensors"), metadata={"format": "pt"})
    else:
        index: dict[str, Any] = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                                 "weight_map": {}}  # fmt: skip
        for i, shard in enumerate(shards, start=1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(partial, fname), metadata={"format": "pt"})
            index["weight_map"].update(dict.fromkeys(shard, fname))
        with open(os.path.join(partial, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    for name in HF_SIDE_FILES:
        if os.path.isfile(os.path.join(config_dir, name)):
            shutil.copy2(os.path.join(config_dir, name), os.path.join(partial, name))
    _publish(partial, final)
