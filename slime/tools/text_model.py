"""Take the text model out of a released Qwen3.5 checkpoint, and put a trained one back.

    python -m slime.tools.text_model extract --hf-checkpoint Qwen3.5-9B --out Qwen3.5-9B-text
    python -m slime.tools.text_model merge --text TRAINED --hf-checkpoint Qwen3.5-9B --out Qwen3.5-9B-trained

Qwen3.5's released checkpoints are the vision-language model (model_type `qwen3_5` /
`qwen3_5_moe`: the vision tower under `model.visual`, the language model under
`model.language_model`). The Megatron backend builds their text model (`qwen3_5_text` /
`qwen3_5_moe_text`) from the released checkpoint itself; `extract` writes that text model as a
checkpoint of its own (for tools that take a causal LM, transformers' AutoModelForCausalLM):
config.json is the checkpoint's `text_config` (architectures `Qwen3_5ForCausalLM`), the weights
are the language model's with `model.` names, `lm_head` and any other top-level tensors
(`mtp.*`) as they are, the vision tower's left out, and the other files (tokenizer, chat
template, generation config) copied. `merge` writes the vision-language checkpoint again with
the trained text model's weights: the vision tower's (and any tensor the text checkpoint does
not hold, such as `mtp.*` a trainer did not save) come from --hf-checkpoint, and every tensor of
it must be there, with its shape.

Shards are read and written one at a time, so memory holds one shard. The output is written
beside --out and renamed into place when complete: an error leaves no half-written directory.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any

from slime.utils.files import staged_directory
from slime.utils.model_families import FAMILIES, VISION, language_name, text_name

TEXT_MODELS = {f.model_type: f.text_model for f in FAMILIES.values() if f.text_model}
"""A vision-language model_type -> its text model's (slime.utils.model_families)."""

NOT_COPIED = (
    "model.safetensors.index.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
"""Files `extract` does not copy (the weights' index is written anew; the processors read images)."""


class TextModelError(Exception):
    """Bad input, said in one line naming the file and the fix."""


def _config(path: str) -> dict[str, Any]:
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise TextModelError(
            f"{file} cannot be read ({e}): give a Hugging Face checkpoint directory"
        ) from None


def _vision_config(path: str) -> dict[str, Any]:
    config = _config(path)
    if config.get("model_type") not in TEXT_MODELS or "text_config" not in config:
        raise TextModelError(
            f"--hf-checkpoint {path} is model_type {config.get('model_type')!r}: this tool takes "
            f"the vision-language checkpoints {', '.join(TEXT_MODELS)} (their text_config)"
        )
    return config


def _shards(path: str) -> list[str]:
    """The checkpoint's weight files: those its index names (other *.safetensors files beside
    them, an adapter's, are not its weights), else its one model.safetensors."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        names = ["model.safetensors"]
    else:
        raise TextModelError(f"{path} has no model.safetensors or model.safetensors.index.json")
    return [os.path.join(path, name) for name in names]


def _add(into: dict[str, Any], tensors: dict[str, Any], shard: str) -> None:
    """`tensors` into `into`, refusing a name two shards hold."""
    twice = next((name for name in tensors if name in into), None)
    if twice is not None:
        raise TextModelError(
            f"tensor {twice!r} is in two shards ({shard} and another): a checkpoint written twice "
            "into one directory?"
        )
    into.update(tensors)


class _ShardWriter:
    """Writes each non-empty group of tensors as the next shard; `close` names them
    model-XXXXX-of-YYYYY.safetensors and writes the index."""

    def __init__(self, folder: str):
        self.folder, self.total = folder, 0
        self.groups: list[list[str]] = []  # each shard's tensor names

    def write(self, tensors: dict[str, Any]) -> None:
        from safetensors.torch import save_file

        if not tensors:
            return
        save_file(tensors, os.path.join(self.folder, f".shard-{len(self.groups)}"), metadata={"format": "pt"})
        self.groups.append(sorted(tensors))
        self.total += sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self) -> None:
        weight_map = {}
        for i, names in enumerate(self.groups):
            name = f"model-{i + 1:05d}-of-{len(self.groups):05d}.safetensors"
            os.replace(os.path.join(self.folder, f".shard-{i}"), os.path.join(self.folder, name))
            weight_map.update(dict.fromkeys(names, name))
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(self.folder, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)


def _copy_files(src: str, dst: str, leave: tuple[str, ...]) -> None:
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name not in leave:
            shutil.copy2(path, os.path.join(dst, name))


def extract(hf_checkpoint: str, out: str) -> dict[str, int]:
    """Write the text model of `hf_checkpoint` to `out`; the counts of tensors kept and left out."""
    from safetensors.torch import load_file
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    config = _vision_config(hf_checkpoint)
    text_type = TEXT_MODELS[config["model_type"]]
    text = dict(
        config["text_config"],
        model_type=text_type,
        architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[text_type]],
    )
    for key in ("torch_dtype", "dtype", "transformers_version"):
        if key in config and key not in text:
            text[key] = config[key]
    if "tie_word_embeddings" in config:  # the vision-language model ties (or not) by its own key
        text["tie_word_embeddings"] = config["tie_word_embeddings"]
    shards = _shards(hf_checkpoint)
    counts = {"kept": 0, "vision tower": 0}
    with staged_directory(out) as staging:
        writer = _ShardWriter(staging)
        seen: dict[str, Any] = {}
        for shard in shards:
            tensors = load_file(shard)
            _add(seen, dict.fromkeys(tensors), shard)
            kept = {name: v for k, v in tensors.items() if (name := text_name(k)) is not None}
            counts["vision tower"] += len(tensors) - len(kept)
            counts["kept"] += len(kept)
            writer.write(kept)
        writer.close()
        _copy_files(hf_checkpoint, staging, ("config.json", *NOT_COPIED))
        with open(os.path.join(staging, "config.json"), "w") as f:
            json.dump(text, f, indent=2)
    return counts


def merge(text: str, hf_checkpoint: str, out: str) -> dict[str, int]:
    """Write `hf_checkpoint` to `out` with the language model's tensors (and any other it holds)
    taken from the text checkpoint `text`, each cast to the original's dtype; the counts of
    tensors by where they came from."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    config = _vision_config(hf_checkpoint)
    text_type = TEXT_MODELS[config["model_type"]]
    if _config(text).get("model_type") != text_type:
        raise TextModelError(
            f"--text {text} is model_type {_config(text).get('model_type')!r}; --hf-checkpoint "
            f"{hf_checkpoint}'s text model is {text_type!r}"
        )
    wanted: dict[str, tuple[list[int], str, str]] = {}  # the checkpoint's name -> shape, dtype, shard
    for shard in _shards(hf_checkpoint):
        with safe_open(shard, "pt") as f:
            found = {
                k: (list(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype(), shard) for k in f.keys()
            }
        _add(wanted, found, shard)
    counts = {"from the text model": 0, "vision tower": 0, "other, kept": 0}
    taken: dict[str, Any] = {}
    with staged_directory(out) as staging:
        writer = _ShardWriter(staging)
        for shard in _shards(text):
            renamed = {}
            for name, tensor in load_file(shard).items():
                full = language_name(name)  # (transformers' save of the whole model: as it is)
                if full not in wanted:
                    raise TextModelError(
                        f"--text {text}: tensor {name!r} ({full!r} in the vision-language model) is "
                        f"not in --hf-checkpoint {hf_checkpoint}: a text model of another shape"
                    )
                shape, dtype, _ = wanted[full]
                if list(tensor.shape) != shape:
                    raise TextModelError(
                        f"--text {text}: tensor {name!r} is {list(tensor.shape)}, --hf-checkpoint "
                        f"{hf_checkpoint}'s {full!r} is {shape}"
                    )
                renamed[full] = _cast(tensor, dtype)
            _add(taken, dict.fromkeys(renamed), shard)
            writer.write(renamed)
            counts["from the text model"] += len(renamed)
        # Everything but the vision tower and the MTP modules is the text model's to give (an
        # untied lm_head included): one missing would silently stay untrained.
        missing = [k for k in wanted if k not in taken and not k.startswith((VISION, "mtp."))]
        if missing:
            raise TextModelError(
                f"--text {text} lacks {len(missing)} tensor(s) of the text model, e.g. "
                f"{text_name(missing[0])!r}: give a whole checkpoint of it"
            )
        for shard in sorted({wanted[k][2] for k in wanted if k not in taken}):  # one shard at a time
            with safe_open(shard, "pt") as f:
                rest = {k: f.get_tensor(k) for k in f.keys() if k not in taken}
            counts["vision tower"] += sum(k.startswith(VISION) for k in rest)
            counts["other, kept"] += sum(not k.startswith(VISION) for k in rest)
            writer.write(rest)
        writer.close()
        _copy_files(hf_checkpoint, staging, ("model.safetensors.index.json",))
    return counts


def _cast(tensor: Any, dtype: str) -> Any:
    """`tensor` in the original's floating-point dtype (safetensors' name of it); others as they are."""
    import torch

    from slime.utils.weight_delta import SAFETENSORS_DTYPES

    if not tensor.is_floating_point() or dtype not in SAFETENSORS_DTYPES:
        return tensor
    return tensor.to(getattr(torch, SAFETENSORS_DTYPES[dtype]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m slime.tools.text_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    e = sub.add_parser("extract", help="write the text model of a vision-language checkpoint")
    e.add_argument("--hf-checkpoint", required=True, help="the released vision-language checkpoint")
    e.add_argument("--out", required=True, help="the text model's directory (replaced if it exists)")
    m = sub.add_parser("merge", help="write the vision-language checkpoint with a trained text model")
    m.add_argument("--text", required=True, help="the trained text model (e.g. a --save-hf directory)")
    m.add_argument(
        "--hf-checkpoint", required=True, help="the vision-language checkpoint it was extracted from"
    )
    m.add_argument("--out", required=True, help="the new vision-language checkpoint (replaced if it exists)")
    args = p.parse_args(argv)
    out = os.path.realpath(args.out)
    for flag, path in (("--hf-checkpoint", args.hf_checkpoint), ("--text", getattr(args, "text", None))):
        if path is not None and os.path.commonpath([out, os.path.realpath(path)]) == out:
            p.error(
                f"--out {args.out} is {flag} {path} or holds it, and --out is replaced: write the result "
                "elsewhere"
            )
    try:
        if args.command == "extract":
            counts = extract(args.hf_checkpoint, args.out)
        else:
            counts = merge(args.text, args.hf_checkpoint, args.out)
    except TextModelError as err:
        p.error(str(err))
    sys.stdout.write(json.dumps({"out": args.out, "tensors": counts}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
