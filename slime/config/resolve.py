"""`auto`: what a flag left unset means, decided once from the device, the installed packages and
the flags given, and reported in the start-up banner (`Resolution.lines`).

A slime launch script names no backend and no device: in slime that means SGLang engines and
Megatron training on GPUs. The same script means the same here on a GPU machine; on a machine
without GPUs the built-in torch engine and FSDP run it on CPU processes, which is what the demo
and the tests rely on. `--dry-run` plans for GPUs when this machine has none, since the script is
being checked for the cluster it was written for (`--device cpu` plans for this machine).

    --device auto             cuda when torch sees a GPU (or for --dry-run), else cpu
    --rollout-backend auto    sglang on cuda, torch on cpu
    --train-backend auto      megatron on cuda, fsdp on cpu
    --transformer-impl auto   transformer_engine for megatron on cuda (Megatron-LM's default), else local
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass, field


@dataclass
class Resolution:
    lines: list[str] = field(default_factory=list)
    """One line per resolved setting: `device: cuda (auto: a GPU is visible)`."""
    planning_elsewhere: bool = False
    """--dry-run for GPUs on a machine without one: package checks are warnings, not problems."""


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


def resolved(ns: argparse.Namespace) -> bool:
    return "auto" not in (
        ns.device,
        getattr(ns, "train_backend", None),
        getattr(ns, "transformer_impl", None),
    )


def resolve(ns: argparse.Namespace) -> Resolution:
    """Replace every `auto` in `ns` by its value; returns how each was decided."""
    out = Resolution()
    visible = _cuda_visible()
    why = "given"
    if ns.device == "auto":
        if visible:
            ns.device, why = "cuda", "auto: a GPU is visible"
        elif getattr(ns, "dry_run", False):
            ns.device, why = (
                "cuda",
                "auto: --dry-run plans for a GPU machine; --device cpu plans for this one",
            )
        else:
            ns.device, why = "cpu", "auto: no GPU is visible"
    # Planning for GPUs from a machine without one: what is installed here does not matter.
    out.planning_elsewhere = ns.device == "cuda" and not visible
    out.lines.append(f"device: {ns.device} ({why})")
    if getattr(ns, "rollout_backend", None) == "auto":
        ns.rollout_backend = "sglang" if ns.device == "cuda" else "torch"
        engines = (
            "SGLang engines on GPUs, as in slime" if ns.device == "cuda" else "the built-in engine on CPU"
        )
        why = f"auto: {engines}"
        out.lines.append(f"rollout backend: {ns.rollout_backend} ({why})")
    elif hasattr(ns, "rollout_backend"):
        out.lines.append(f"rollout backend: {ns.rollout_backend} (given)")
    why = "given"
    if getattr(ns, "train_backend", "fsdp") == "auto":
        ns.train_backend = "megatron" if ns.device == "cuda" else "fsdp"
        why = f"auto: {'Megatron on GPUs, as in slime' if ns.device == 'cuda' else 'FSDP on CPU'}"
    backend = getattr(ns, "train_backend", "fsdp")
    out.lines.append(f"train backend: {backend} ({why})")
    if ns.transformer_impl == "auto":  # (LoRA's adapters need the local spec: slime.config.lora)
        te = backend == "megatron" and ns.device == "cuda" and not (getattr(ns, "lora_rank", 0) or 0)
        ns.transformer_impl = "transformer_engine" if te else "local"
        if backend == "megatron":
            out.lines.append(
                f"transformer impl: {ns.transformer_impl} (auto: "
                f"{'Megatron-LM default on GPUs' if te else 'megatron-core local spec on CPU'})"
                if te or ns.device != "cuda"
                else "transformer impl: local (auto: the local spec, which LoRA's adapters need)"
            )
    elif backend == "megatron":
        out.lines.append(f"transformer impl: {ns.transformer_impl} (given)")
    return out


def transformer_engine_problem(impl: str) -> str | None:
    """--transformer-impl transformer_engine without Transformer Engine installed here."""
    if impl == "transformer_engine" and importlib.util.find_spec("transformer_engine") is None:
        return (
            "--transformer-impl transformer_engine: Transformer Engine is not installed "
            "(pip install transformer-engine[pytorch], GPU only); use --transformer-impl local"
        )
    return None


def package_problems(ns: argparse.Namespace) -> list[str]:
    """What the resolved backends need installed on this machine."""
    out = []
    if ns.train_backend == "megatron" and importlib.util.find_spec("megatron") is None:
        out.append(
            "--train-backend megatron needs megatron-core: pip install megatron-core (or --train-backend "
            "fsdp)"
        )
    te = transformer_engine_problem(ns.transformer_impl)
    return out + ([te] if te else [])
