"""PEFT adapter directories on disk: adapter_config.json beside adapter_model.safetensors (or
PEFT's older adapter_model.bin). Read by the trainer (--lora-adapter-path) and the torch engine
(/load_lora_adapter, --lora-paths); written by the trainer's --save-hf."""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Any

import torch

CONFIG, WEIGHTS, OLD_WEIGHTS = "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"

LORA_TENSOR = re.compile(r"^(?:.*?)(layers\.\d+\..+|(?<![^.])lm_head)\.lora_([AB])(?:\.[^.]+)?\.weight$")
"""A LoRA tensor's name under any prefix (PEFT's `base_model.model.`, none, an adapter name):
the module path from `layers.<i>.` on (or the LM head, `lm_head`), and A or B."""


def dump_name(adapter: str, module: str, which: str) -> str:
    """The file name of one adapter tensor in the --debug-sync-parameters-path dumps, the same on
    the trainer's and the engine's side: `<adapter>.<module from layers.>.lora_<A|B>.weight`."""
    return f"{adapter}.{module}.lora_{which}.weight"


def read_adapter_dir(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config, tensors by their stored names); the file's own errors (OSError, ValueError, ...)
    propagate for the caller to name the flag or request."""
    with open(os.path.join(path, CONFIG)) as f:
        config = json.load(f)
    if not isinstance(config, dict):
        raise ValueError(f"{CONFIG} is not a JSON object")
    weights = os.path.join(path, WEIGHTS)
    if os.path.isfile(weights):
        from safetensors.torch import load_file

        return config, load_file(weights)
    return config, torch.load(os.path.join(path, OLD_WEIGHTS), map_location="cpu", weights_only=True)


def write_adapter_dir(path: str, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Written under a temporary name and renamed when complete (an existing one is replaced)."""
    from safetensors.torch import save_file

    final = os.path.abspath(path)
    partial = final + ".partial"
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    save_file(
        {n: t.detach().cpu().contiguous() for n, t in tensors.items()},
        os.path.join(partial, WEIGHTS),
        metadata={"format": "pt"},
    )
    with open(os.path.join(partial, CONFIG), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(partial, final)
