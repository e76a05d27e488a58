"""Megatron checkpoints on disk (Megatron-LM's torch layout), and HF checkpoints in and out.

    DIR/latest_checkpointed_iteration.txt          "release" (converted) or the iteration number
    DIR/release/mp_rank_{tp:02d}/model_optim_rng.pt            PP = 1
    DIR/release/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt   PP > 1
    DIR/release/mp_rank_{tp:02d}[_{pp:03d}]_{ep:03d}/...       EP > 1 (slime.backends.megatron.rank_files)
        {"model": state dict, "checkpoint_version": 3.0, "iteration": int, "args": {...}}

`args` is a plain dict (loadable with `torch.load(weights_only=True)`) with Megatron's argument
names for the model shape and layout (tensor_model_parallel_size, pipeline_model_parallel_size,
num_layers, hidden_size, ffn_hidden_size, num_attention_heads, num_query_groups, kv_channels,
padded_vocab_size, make_vocab_size_divisible_by, untie_embeddings_and_output_weights, ...) and
`slime_layout` (slime.backends.megatron.convert.Layout). A directory is written under a temporary
name and renamed when complete; an existing non-empty target is refused.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shutil
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from slime.backends.checkpointing import TRACKER
from slime.backends.megatron.convert import ConversionError, Layout, State
from slime.backends.megatron.rank_files import Key, Parallel

HF_SIDE_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


def megatron_args(
    layout: Layout, tp: int, pp: int, ep: int = 1, etp: int | None = None, value_head: bool = False
) -> dict[str, Any]:
    """Megatron-LM's argument names for the model and layout; `value_head` (slime's): a PPO
    critic's, whose output layer is its value head (one row and a bias) instead of the vocabulary."""
    return {
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": pp,
        "decoder_first_pipeline_num_layers": layout.first_stage_layers,
        "decoder_last_pipeline_num_layers": layout.last_stage_layers,
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp or tp,
        "num_experts": layout.num_experts or None,
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
        "qk_layernorm": layout.qk_norm or bool(layout.kv_lora_rank),  # MLA: the two latent norms
        "swiglu": True,
        "normalization": "RMSNorm",
        "rotary_percent": layout.rotary_percent,
        "rotary_interleaved": layout.rotary_interleaved,
        "post_self_attn_layernorm": layout.post_norms,
        "post_mlp_layernorm": layout.post_norms,
        **_moe_args(layout),
        **layout.mla_args(),
        "slime_layout": dict(layout.__dict__),
        **({"value_head": True} if value_head else {}),
    }


def _moe_args(layout: Layout) -> dict[str, Any]:
    if not layout.num_experts:
        return {}
    return {
        "moe_ffn_hidden_size": layout.moe_ffn_hidden_size,
        "moe_layer_freq": list(layout.moe_layers),
        "moe_shared_expert_intermediate_size": layout.shared_ffn_hidden_size or None,
        "moe_router_enable_expert_bias": layout.expert_bias,
    }


def rank_dir(tp_rank: int, pp_stage: int, pp: int, ep_rank: int | None = None) -> str:
    """Megatron-LM's names: mp_rank_TT, mp_rank_TT_PPP with PP > 1, and an _EEE suffix for the
    expert-parallel rank with EP > 1 (`ep_rank` given)."""
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_stage:03d}"
    return name if ep_rank is None else f"{name}_{ep_rank:03d}"


def check_target(save_dir: str, flag: str = "--save-dir") -> None:
    """A target must not hold anything yet (nothing is overwritten)."""
    if os.path.exists(save_dir) and (not os.path.isdir(save_dir) or os.listdir(save_dir)):
        raise ConversionError(f"{flag} {save_dir!r} already exists and is not empty: choose a new directory")


def publish(partial: str, final: str) -> None:
    if os.path.isdir(final):  # empty (checked before): replaced by the complete one
        os.rmdir(final)
    os.replace(partial, final)


def save_megatron(
    parts: Mapping[Key, State], layout: Layout, save_dir: str, par: Parallel, iteration: str = "release"
) -> None:
    """Write every (TP rank, stage, EP rank) shard of `par` (rank_files.split_ranks) as one file."""
    check_target(save_dir)
    final = os.path.abspath(save_dir)
    partial = final + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    args = megatron_args(layout, par.tp, par.pp, par.ep, par.expert_tp)
    for (t, s, e), state in sorted(parts.items()):
        folder = os.path.join(partial, iteration, rank_dir(t, s, par.pp, e if par.ep > 1 else None))
        os.makedirs(folder)
        torch.save(
            {
                "model": {k: v.contiguous() for k, v in state.items()},
                "checkpoint_version": 3.0,
                "iteration": 0 if iteration == "release" else int(iteration),
                "args": args,
            },
            os.path.join(folder, "model_optim_rng.pt"),
        )
    with open(os.path.join(partial, TRACKER), "w") as f:
        f.write(iteration + "\n")
    publish(partial, final)


def check_no_adapters(parts: Mapping[Any, State], load_dir: str) -> None:
    """The conversion tools move a model's weights; a LoRA run's checkpoint (its adapters beside
    the frozen base, `lora_adapters.*`) is refused rather than written without them."""
    if any(name.startswith("lora_adapters.") for part in parts.values() for name in part):
        raise ConversionError(
            f"--load-dir {load_dir}: a LoRA run's checkpoint (its adapters beside the frozen base model), "
            "which the conversion tools do not carry; the run's --save-hf writes the adapter as a PEFT "
            "directory, and with --lora-save-merged the merged model"
        )


def load_megatron(load_dir: str) -> tuple[dict[Key, State], dict[str, Any]]:
    """Every (TP rank, stage, EP rank) state dict of the tracked iteration, and the stored args."""
    tracker = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(tracker):
        raise ConversionError(
            f"--load-dir {load_dir!r} has no {TRACKER}: not a Megatron checkpoint directory"
        )
    with open(tracker) as f:
        iteration = f.read().strip()
    folder = os.path.join(load_dir, iteration if iteration == "release" else f"iter_{int(iteration):07d}")
    parts: dict[Key, State] = {}
    args: dict[str, Any] = {}
    for path in sorted(glob.glob(os.path.join(folder, "mp_rank_*", "model_optim_rng.pt"))):
        blob = torch.load(path, map_location="cpu", weights_only=True)
        args = blob.get("args") or {}
        if args.get("value_head"):  # refused at the first file, before reading them all
            raise ConversionError(
                f"--load-dir {load_dir!r} is a PPO critic's checkpoint (its output layer is a value head): "
                "the conversion tools take language models; the critic's --save-hf export "
                "(<--save-hf>/critic) is its Hugging Face directory"
            )
        name = os.path.basename(os.path.dirname(path))
        ranks = [int(x) for x in re.findall(r"_(\d+)", name)]
        pp, ep = args.get("pipeline_model_parallel_size") or 1, args.get("expert_model_parallel_size") or 1
        if len(ranks) != 1 + (pp > 1) + (ep > 1):
            raise ConversionError(f"{path}: the name does not fit PP {pp} x EP {ep} (mp_rank_TT[_PPP][_EEE])")
        parts[(ranks[0], ranks[1] if pp > 1 else 0, ranks[-1] if ep > 1 else 0)] = blob["model"]
    if not parts:
        raise ConversionError(f"--load-dir {load_dir!r}: no mp_rank_*/model_optim_rng.pt under {folder}")
    return parts, args


def stored_parallel(args: dict[str, Any]) -> Parallel:
    """The layout a checkpoint was written with (Megatron-LM's argument names)."""
    tp = args.get("tensor_model_parallel_size") or 1
    return Parallel(
        tp,
        args.get("pipeline_model_parallel_size") or 1,
        args.get("expert_model_parallel_size") or 1,
        args.get("expert_tensor_parallel_size") or tp,
    )


def stored_layout(args: dict[str, Any], load_dir: str) -> Layout:
    if "slime_layout" not in args:
        raise ConversionError(
            f"--load-dir {load_dir!r}: the checkpoint's args carry no slime_layout (not written by slime)"
        )
    return Layout(**args["slime_layout"])


class LazyHFState(Mapping):
    """An HF checkpoint's tensors by name, each read from its safetensors file when asked for
    (a train rank converts only its own shard: hf_to_megatron_shard). A released Qwen3.5
    checkpoint (vision-language) reads as its language model: text model names, no vision tower
    (`as_text` False: every tensor by its stored name)."""

    def __init__(self, hf_dir: str, as_text: bool = True):
        from safetensors import safe_open

        from slime.utils.model_families import text_name

        files = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
        if not files:
            raise ConversionError(f"--hf-checkpoint {hf_dir!r} holds no *.safetensors weights")
        rename = text_name if as_text and is_vision_language(hf_dir) else (lambda name: name)
        self._handles = [safe_open(path, framework="pt") for path in files]
        self._where = {
            key: (h, name) for h in self._handles for name in h.keys() if (key := rename(name)) is not None
        }

    def __getitem__(self, name: str) -> torch.Tensor:
        handle, stored = self._where[name]
        return handle.get_tensor(stored)

    def __contains__(self, name: object) -> bool:  # without reading the tensor
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        """A tensor's shape, without reading it."""
        handle, stored = self._where[name]
        return tuple(handle.get_slice(stored).get_shape())

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


@functools.lru_cache(maxsize=16)
def is_vision_language(hf_dir: str) -> bool:
    """Whether `hf_dir` is a vision-language checkpoint whose text model the backend builds
    (released Qwen3.5: model_families.Family.text_model). Read once per directory: every push,
    export and save asks."""
    from slime.utils.model_families import family

    try:
        with open(os.path.join(hf_dir, "config.json")) as file:
            found = family(json.load(file).get("model_type"))
    except (OSError, ValueError):
        return False
    return found is not None and found.text_model is not None


@functools.lru_cache(maxsize=4)
def _stored_tensors(hf_dir: str) -> LazyHFState:
    """A released checkpoint's tensors by their stored names, opened once (each push reads its
    vision tower from them, --save-hf what the model does not hold)."""
    return LazyHFState(hf_dir, as_text=False)


def as_stored(
    named: Iterable[tuple[str, torch.Tensor]], hf_dir: str, yields: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """The exported (HF name, tensor) pairs as --hf-checkpoint `hf_dir` holds them: a released
    Qwen3.5's language model renamed (model_families.language_name), then, on the ranks that
    `yields`, its vision tower as loaded (the engine serves the whole model, and
    --check-weight-sync checks every tensor it holds); another checkpoint's as they are."""
    if not is_vision_language(hf_dir):
        yield from named
        return
    from slime.utils.model_families import VISION, language_name

    device = torch.device("cpu")
    for name, tensor in named:
        device = tensor.device
        yield language_name(name), tensor
    if yields:
        stored = _stored_tensors(hf_dir)
        yield from ((name, stored[name].to(device)) for name in stored if name.startswith(VISION))


def stored_shapes(shapes: dict[str, tuple[int, ...]], hf_dir: str) -> dict[str, tuple[int, ...]]:
    """`as_stored`'s names and shapes, from the exported tensors' `shapes` (no tensor read)."""
    if not is_vision_language(hf_dir):
        return shapes
    from slime.utils.model_families import VISION, language_name

    stored = _stored_tensors(hf_dir)
    vision = {name: stored.shape(name) for name in stored if name.startswith(VISION)}
    return {**{language_name(name): shape for name, shape in shapes.items()}, **vision}


def load_hf_state(hf_dir: str) -> State:
    """Every tensor of an HF checkpoint (LazyHFState's names), read now."""
    lazy = LazyHFState(hf_dir)
    return {name: lazy[name] for name in lazy}


def vision_language_state(state: State, hf_dir: str) -> State:
    """A text model's `state` as its vision-language checkpoint `hf_dir` holds it: the names
    renamed (model_families.language_name), and the tensors `state` does not hold (the vision
    tower, MTP modules not built) read from `hf_dir` as they are."""
    from slime.utils.model_families import language_name

    out = {language_name(name): t for name, t in state.items()}
    stored = _stored_tensors(hf_dir)
    return {**{name: stored[name] for name in stored if name not in out}, **out}


def save_hf(
    state: State, config_dir: str, save_dir: str, shard_bytes: int = 2 << 30, config: Any = None
) -> None:
    """safetensors (sharded past `shard_bytes`, with an index) plus config and tokenizer files
    copied from `config_dir` (`config`: a Hugging Face config written instead of its
    config.json); written under a temporary name and renamed."""
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
        index: dict[str, Any] = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
            "weight_map": {},
        }
        for i, shard in enumerate(shards, start=1):
            fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(partial, fname), metadata={"format": "pt"})
            index["weight_map"].update(dict.fromkeys(shard, fname))
        with open(os.path.join(partial, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    if config is not None:
        config.to_json_file(os.path.join(partial, "config.json"))
    for name in HF_SIDE_FILES:
        if name == "config.json" and config is not None:
            continue
        if os.path.isfile(os.path.join(config_dir, name)):
            shutil.copy2(os.path.join(config_dir, name), os.path.join(partial, name))
    publish(partial, final)
