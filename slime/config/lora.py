"""LoRA (issue 25): train low-rank adapters on the policy's linear layers, the base weights frozen.

slime has no LoRA; the flags are those of its fork Miles: `--lora-rank` (0: off), `--lora-alpha`,
`--lora-dropout`, `--target-modules` (Hugging Face module names, comma-separated, or
`all-linear`), `--exclude-modules`, `--lora-adapter-path` (start from a trained PEFT adapter).
The adapter is PEFT's LoRA (y = W x + (alpha / r) B A dropout(x), B zero at the start, so the
first step's model is the base model bitwise).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from slime.config.flags import add_flags, flag, from_flags

ALL_LINEAR = "all-linear"
"""PEFT's name for every linear layer but the output layer (the LM head)."""
ADAPTER_NAME = "slime_lora"
"""The name the adapter push loads the policy's adapter under in the engines (`lora_path`)."""
PUSH_MODES = ("merged", "adapter")
MEGATRON_TE = (
    "--lora-rank with --transformer-impl transformer_engine: Transformer Engine's layers fold the layer "
    "norm into the linear layer, whose normed input the adapters need; use --transformer-impl local"
)
"""Why the Megatron backend's adapters are refused with Transformer Engine's layers."""


@dataclass(frozen=True)
class LoRAConfig:
    rank: int = flag("--lora-rank", 0)
    """train LoRA adapters of this rank on --target-modules, the base weights frozen (0: off)"""
    alpha: int = flag("--lora-alpha", 16)
    """the adapters' output is scaled by alpha / rank"""
    dropout: float = flag("--lora-dropout", 0.0)
    """dropout on the adapters' input"""
    target_modules: tuple[str, ...] = flag("--target-modules", (), unset=None)
    """the linear layers that get adapters: Hugging Face module names, comma-separated
    (q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj), or all-linear (every linear layer but
    the LM head)"""
    target_parameters: tuple[str, ...] = flag("--target-parameters", (), unset=None)
    """(PEFT's target_parameters) parameters that get adapters, comma-separated: a mixture-of-experts
    model's fused experts (mlp.experts.gate_up_proj,mlp.experts.down_proj) or router (mlp.gate.weight);
    all-linear and the expert names gate_proj,up_proj,down_proj,gate reach them where PEFT maps those"""
    exclude_modules: tuple[str, ...] = flag("--exclude-modules", (), unset=None)
    """module names (comma-separated) left without an adapter"""
    adapter_path: str | None = flag("--lora-adapter-path", None)
    """a PEFT adapter directory (adapter_config.json, adapter_model.safetensors) to start from; its
    rank and alpha must be the flags', and its tensors the adapters --target-modules gives"""
    push: str = flag("--lora-push", "merged", unset=None, choices=PUSH_MODES)
    """(ours) merged (default): push the base weights with the adapters merged, to any engine;
    adapter: push the adapters alone (1-2% of the bytes), which the engines serve as 'slime_lora'
    and every rollout request names (SGLang's lora_path)"""
    save_merged: bool = flag("--lora-save-merged", False)
    """(ours) --save-hf also writes the base model with the adapters merged, a plain Hugging Face
    checkpoint, into <--save-hf>/merged"""

    @property
    def pushes_adapter(self) -> bool:
        return self.enabled and self.push == "adapter"

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


def dump_record(lora: LoRAConfig) -> dict[str, object] | None:
    """What the rollout and train dumps record of LoRA (None without it). With `adapter` the
    engines served ADAPTER_NAME, whose version is the samples' weight_version (each push sets it)."""
    if not lora.enabled:
        return None
    return {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "target_modules": list(lora.target_modules),
        "target_parameters": list(lora.target_parameters),
        "push": lora.push,
        "adapter": ADAPTER_NAME if lora.pushes_adapter else None,
        "adapter_path": lora.adapter_path,
    }


def from_namespace(ns: argparse.Namespace) -> LoRAConfig:
    """The LoRA settings of flags parse_args already checked (no checks again: a process on
    another node may not see --lora-adapter-path)."""
    if (getattr(ns, "lora_rank", 0) or 0) <= 0:
        return LoRAConfig()
    return from_flags(
        LoRAConfig,
        ns,
        target_modules=_names(ns.target_modules),
        target_parameters=_names(getattr(ns, "target_parameters", None)),
        exclude_modules=_names(getattr(ns, "exclude_modules", None)),
    )


def add_lora_arguments(parser: argparse.ArgumentParser) -> None:
    title = "LoRA (Miles's flags)"
    add_flags(parser, LoRAConfig, title)


def _names(value: str | None) -> tuple[str, ...]:
    return tuple(n.strip() for n in (value or "").split(",") if n.strip())


def lora_config(ns: argparse.Namespace) -> LoRAConfig:
    """The LoRA settings of parsed flags; ValueError names the flag on bad input."""
    rank = getattr(ns, "lora_rank", 0) or 0
    given = [
        f
        for f, v in (
            ("--target-modules", getattr(ns, "target_modules", None)),
            ("--target-parameters", getattr(ns, "target_parameters", None)),
            ("--lora-push", getattr(ns, "lora_push", None)),
            ("--exclude-modules", getattr(ns, "exclude_modules", None)),
            ("--lora-adapter-path", getattr(ns, "lora_adapter_path", None)),
            ("--lora-save-merged", getattr(ns, "lora_save_merged", False)),
        )
        if v
    ]
    if rank < 0:
        raise ValueError(f"--lora-rank must be >= 0 (0: no LoRA), got {rank}")
    if rank == 0:
        if given:
            raise ValueError(f"{given[0]} configures LoRA: give --lora-rank too (or drop the flag)")
        return LoRAConfig()
    if ns.lora_alpha <= 0:
        raise ValueError(f"--lora-alpha must be > 0, got {ns.lora_alpha}")
    if not 0.0 <= ns.lora_dropout < 1.0:
        raise ValueError(f"--lora-dropout must be in [0, 1), got {ns.lora_dropout}")
    targets = _names(ns.target_modules)
    if not targets and not _names(getattr(ns, "target_parameters", None)):
        raise ValueError(
            f"--lora-rank {rank} needs --target-modules: Hugging Face module names (q_proj,v_proj,...) or "
            f"{ALL_LINEAR} (or --target-parameters)"
        )
    if ALL_LINEAR in targets and len(targets) > 1:
        raise ValueError(f"--target-modules {ALL_LINEAR} names every linear layer: give it alone")
    adapter = ns.lora_adapter_path
    if adapter is not None and not os.path.isfile(os.path.join(adapter, "adapter_config.json")):
        raise ValueError(
            f"--lora-adapter-path {adapter!r} has no adapter_config.json: not a PEFT adapter directory "
            "(the --save-hf export of a LoRA run writes one)"
        )
    if getattr(ns, "enable_mtp_training", False):
        raise ValueError(
            "--enable-mtp-training with --lora-rank: the multi-token prediction modules get no adapters "
            "and the base stays frozen, so nothing of them would train; drop one of the flags"
        )
    if getattr(ns, "train_vision_model", False):
        raise ValueError(
            "--train-vision-model with --lora-rank: the adapters are the language model's and only they "
            "train, the vision tower stays frozen; drop one of the flags"
        )
    ref_load = getattr(ns, "ref_load", None)
    if ref_load and os.path.realpath(ref_load) != os.path.realpath(ns.hf_checkpoint):
        raise ValueError(
            f"--ref-load {ref_load!r} with --lora-rank: a LoRA run's reference is its base model "
            "(--hf-checkpoint) with the adapters off; drop --ref-load"
        )
    if getattr(ns, "use_opd", False) and getattr(ns, "opd_type", None) == "megatron":
        raise ValueError(
            "--opd-type megatron with --lora-rank: the teacher's weights cannot replace a LoRA model's in "
            "the train pass yet; use --opd-type sglang (a teacher engine)"
        )
    if getattr(ns, "lora_save_merged", False) and not getattr(ns, "save_hf", None):
        raise ValueError(
            "--lora-save-merged writes the merged model beside --save-hf's adapter: give --save-hf DIR"
        )
    push = getattr(ns, "lora_push", None) or "merged"
    if push == "adapter":
        problem = adapter_push_problem(ns)
        if problem:
            raise ValueError(problem)
    return from_namespace(ns)


def adapter_push_problem(ns: argparse.Namespace) -> str | None:
    """What rules `--lora-push adapter` out (slime.bridge.adapter says why)."""
    from slime.config.rollout import default_transport, resolve_kind

    device = getattr(ns, "device", "cpu")
    transport = getattr(ns, "update_weight_transport", None) or default_transport(
        device, getattr(ns, "colocate", False)
    )
    kind = resolve_kind("tensor" if transport == "nccl" else transport, device)
    if kind in ("distributed", "disk"):
        return (
            f"--lora-push adapter with --update-weight-transport {transport}: the adapter is handed over "
            "as tensors on the trainer's node (shared memory, or CUDA IPC with --colocate); no engine "
            "route takes an adapter through a process group. Use --colocate on GPU, or --lora-push merged"
        )
    if getattr(ns, "rollout_backend", "torch") == "sglang" and getattr(ns, "fully_async", False):
        return sglang_async_problem("--fully-async")
    return None


def sglang_async_problem(schedule: str) -> str:
    return (
        f"--lora-push adapter to SGLang engines with {schedule}: upstream SGLang replaces an adapter only "
        "by unloading it, which waits for the requests using it, and this schedule pushes while requests "
        "run (they would never finish); use train.py, or --lora-push merged"
    )


def engine_launch_args(lora: LoRAConfig, sglang: bool, given: tuple[str, ...] = ()) -> list[str]:
    """The engine flags that serve the pushed adapter: `--enable-lora`; SGLang also needs the
    adapters' largest rank and target modules up front (`--max-lora-rank`, `--lora-target-modules`:
    its short names, `all` for all-linear), unless `--sglang-*` flags gave them (`given`)."""
    if not lora.pushes_adapter:
        return []

    def has(flag: str) -> bool:
        return any(a == flag or a.startswith(flag + "=") for a in given)

    out = [] if has("--enable-lora") else ["--enable-lora"]
    if not sglang:
        return out
    if not has("--max-lora-rank"):
        out += ["--max-lora-rank", str(lora.rank)]
    if not has("--lora-target-modules"):
        modules = (
            ["all"]
            if ALL_LINEAR in lora.target_modules
            else sorted({m.split(".")[-1] for m in lora.target_modules})
        )
        out += ["--lora-target-modules", *modules]
    return out
