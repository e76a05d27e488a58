"""LoRA adapters on the FSDP actor's Hugging Face model, with PEFT (slime.config.lora).

PEFT's `inject_adapter_in_model` puts its LoRA layers on the model built on the meta device,
before FSDP2 shards it: each target linear layer becomes a LoRA layer holding the frozen base
linear (`<module>.base_layer.weight`) and the adapter (`<module>.lora_A.default.weight` [r, in],
`<module>.lora_B.default.weight` [out, r]). FSDP2 shards adapters and frozen weights alike; only
the adapters require gradients, so only they reach the optimizer.

Names on the way in and out:

- the base weights are read from the checkpoint under their Hugging Face names
  (`checkpoint_name`: `.base_layer` dropped);
- the adapters start from `--lora-adapter-path` (a PEFT directory) or fresh, as PEFT
  initialises them (A: kaiming-uniform as nn.Linear, B: zero), drawn from --seed on the CPU so
  every rank and every run with the seed builds the same;
- a PEFT adapter directory names them `base_model.model.<module>.lora_A.weight` (`peft_name`);
- the engines get the merged weights under the checkpoint's names (`merged`): W + (alpha / r) B A.

A mixture-of-experts model's fused experts and router are parameters, not linear layers: PEFT
adapts them with its `ParamWrapper` (slime.utils.peft_experts has the layout), nested when it
wraps both expert parameters of one module, so a base name may hold `.base_layer` more than once.
`all-linear` and the transformers 4 names (`gate_proj`, `up_proj`, `down_proj`, `gate`) reach
them where PEFT maps those names onto the fused parameters; `--target-parameters` names them.
"""

from __future__ import annotations

import copy
import json
import math
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from slime.config.lora import ALL_LINEAR, LoRAConfig
from slime.utils import peft_experts
from slime.utils.errors import UsageError
from slime.utils.peft_files import read_adapter_dir

ADAPTER = "default"  # PEFT's name of the one adapter in the model
_ADAPTER_PARAM = re.compile(r"^(.*)\.lora_([AB])\.default\.weight$")
PEFT_PREFIX = "base_model.model."


EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj", "gate")
"""The transformers 4 names of an MoE layer's expert projections and router, which PEFT maps onto
the fused parameters of transformers 5 where it knows the family (slime.utils.peft_experts)."""


def peft_config(cfg: LoRAConfig, also_excluded: list[str] | None = None) -> Any:
    """PEFT's LoraConfig of the flags; `also_excluded`: whole module names left without adapters
    besides --exclude-modules (a vision-language model's vision tower). Injection completes it
    (PEFT maps expert names onto parameters): `injected_config` is what the adapter is."""
    from peft import LoraConfig

    targets: Any = ALL_LINEAR if cfg.target_modules == (ALL_LINEAR,) else list(cfg.target_modules)
    excluded = [*cfg.exclude_modules, *(also_excluded or [])]
    return LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        target_parameters=list(cfg.target_parameters) or None,
        exclude_modules=excluded or None,
        bias="none",
        task_type="CAUSAL_LM",
    )


def injected_config(model: nn.Module) -> Any:
    """The PEFT config of the adapters `inject` put on `model`, as PEFT completed it (the
    parameters it wraps, the fused gate_up_proj's rank and alpha): what adapter_config.json says."""
    return model.peft_config[ADAPTER]  # type: ignore[index]


def inject(model: nn.Module, cfg: LoRAConfig) -> nn.Module:
    """PEFT's LoRA layers on `model` (in place); a module name of --target-modules or
    --exclude-modules that names no linear layer is refused, naming it and the model's."""
    from peft import inject_adapter_in_model

    # A vision-language model's adapters are its language model's: the vision tower stays as it is
    # (frozen), its linear layers named whole, as PEFT matches a name or a name's last parts.
    tower = tower_linear(model)
    linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear) and name not in tower]
    experts = any(".experts." in n and p.dim() == 3 for n, p in model.named_parameters())
    for flag, names in (("--target-modules", cfg.target_modules), ("--exclude-modules", cfg.exclude_modules)):
        # PEFT's rule for a plain name: the module's name is it, or ends with "." + it.
        unknown = [
            n
            for n in names
            if n != ALL_LINEAR
            and not any(m == n or m.endswith("." + n) for m in linear)
            and not (experts and flag == "--target-modules" and n in EXPERT_NAMES)
        ]
        if unknown:
            raise UsageError(
                f"{flag} {','.join(unknown)}: no linear layer of this model has that name; its linear "
                f"layers are {', '.join(sorted({m.rsplit('.', 1)[-1] for m in linear}))} (or {ALL_LINEAR})"
                + (
                    f"; its experts and router: --target-parameters (PEFT maps {','.join(EXPERT_NAMES)} onto "
                    "them for the families it knows)"
                    if experts
                    else ""
                )
                + ("; a vision-language model's vision tower takes no adapters" if tower else "")
            )
    params = {n for n, _ in model.named_parameters()}
    unknown = [t for t in cfg.target_parameters if not peft_experts.targets_any(t, params)]
    if unknown:
        raise UsageError(
            f"--target-parameters {','.join(unknown)}: no parameter of this model has that name (PEFT's "
            "rule: a parameter's full name, or its end after a dot, e.g. mlp.experts.gate_up_proj, "
            "mlp.gate.weight)"
        )
    # An adapter on a tied head acts on the head's output alone (PEFT adds B A x after lm_head);
    # merged into the one weight both share, it would change the embedding too.
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    if tied and "lm_head" in cfg.target_modules and (not cfg.pushes_adapter or cfg.save_merged):
        raise UsageError(
            "--target-modules lm_head: this model ties its LM head to the embedding, and merging an adapter "
            "into their one weight (--lora-push merged, --lora-save-merged) would change the embedding "
            "too; push the adapters (--lora-push adapter) or leave lm_head out"
        )
    try:
        model = inject_adapter_in_model(peft_config(cfg, tower), model)
    except ValueError as e:  # PEFT's refusals: LoRA on parameters takes no dropout, a half-named pair
        flags = "--lora-dropout" if "lora_dropout" in str(e) else "--target-modules/--target-parameters"
        raise UsageError(f"{flags}: PEFT refuses these adapters on this model: {e}") from None
    _check_injected(model, cfg)
    return model


def _check_injected(model: nn.Module, cfg: LoRAConfig) -> None:
    """Some layer got an adapter, and every expert parameter PEFT wraps has the layout
    slime.utils.peft_experts reads."""
    flags = (
        f"--target-modules {','.join(cfg.target_modules)} / "
        f"--target-parameters {','.join(cfg.target_parameters)}"
    )
    if not any(_ADAPTER_PARAM.match(n) for n, _ in model.named_parameters()):
        raise UsageError(f"{flags}: no layer got an adapter")
    for name, m in model.named_modules():
        base = m.get_base_layer() if hasattr(m, "parameter_name") else None
        if (
            base is not None
            and getattr(base, m.parameter_name).dim() == 3
            and not peft_experts.is_fused_experts(base)
        ):
            raise UsageError(
                f"{flags}: PEFT adapts {peft_experts.unwrapped(name)}.{m.parameter_name}, experts in a "
                "layout LoRA is not built for here (transposed, or with biases); leave them out"
            )


def tower_linear(model: nn.Module) -> list[str]:
    """The full names of a vision-language model's vision-tower linear layers (none for a text
    model): the layers PEFT is told to leave alone, in the model and in its adapter_config.json."""
    from slime.backends.fsdp.vision import vision_tower

    tower = vision_tower(model)
    if tower is None:
        return []
    prefix = next(n for n, m in model.named_modules() if m is tower) + "."
    return [prefix + n for n, m in tower.named_modules() if isinstance(m, nn.Linear)]


def is_adapter(name: str) -> bool:
    return _ADAPTER_PARAM.match(name) is not None


def adapter_parts(name: str) -> tuple[str, str]:
    """(the module, "A" or "B") of an adapter parameter's name."""
    m = _ADAPTER_PARAM.match(name)
    assert m is not None, name
    return m.group(1), m.group(2)


def checkpoint_name(name: str) -> str:
    """A model parameter's name in the base checkpoint (the frozen linear of a LoRA layer is its
    `base_layer`; nested parameter wrappers put in one each)."""
    return peft_experts.unwrapped(name)


def adapted(model: nn.Module) -> dict[str, str]:
    """Each LoRA module's name -> the full name of the parameter it adapts (a linear layer's
    `<module>.base_layer.weight`; a wrapped parameter's under its innermost base layer)."""
    names = {id(m): n for n, m in model.named_modules()}
    out = {}
    for name, m in model.named_modules():
        if not hasattr(m, "get_base_layer") or ADAPTER not in getattr(m, "lora_A", {}):
            continue
        param = getattr(m, "parameter_name", None)
        out[name] = f"{names[id(m.get_base_layer())]}.{param or 'weight'}"
    return out


def peft_name(name: str) -> str:
    """An adapter parameter's name in a PEFT adapter directory."""
    m = _ADAPTER_PARAM.match(name)
    assert m is not None, name
    return f"{PEFT_PREFIX}{m.group(1)}.lora_{m.group(2)}.weight"


def fresh_adapters(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Every adapter parameter as PEFT initialises it, drawn on the CPU from `seed` in the
    model's parameter order (so every rank draws the same)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        m = _ADAPTER_PARAM.match(name)
        if m is None:
            continue
        t = torch.zeros(tuple(p.shape))
        if m.group(2) == "A":  # B stays zero: the model starts as the base model
            nn.init.kaiming_uniform_(t, a=math.sqrt(5), generator=g)
        out[name] = t
    return out


def read_adapter(path: str, model: nn.Module, cfg: LoRAConfig) -> dict[str, torch.Tensor]:
    """The adapters of a PEFT directory (--lora-adapter-path) under the model's names; its rank
    and alpha must be the flags', and it must hold exactly the model's adapters."""
    try:
        saved, stored = read_adapter_dir(path)
    except Exception as e:  # a missing or truncated file, bad JSON
        raise UsageError(f"--lora-adapter-path {path!r} cannot be read: {type(e).__name__}: {e}") from None
    wrong = [
        f"{key} {saved.get(key)} (the flags: {flag} {want})"
        for key, flag, want in (("r", "--lora-rank", cfg.rank), ("lora_alpha", "--lora-alpha", cfg.alpha))
        if saved.get(key) != want
    ]
    unsupported = [
        f"{key} {saved[key]!r}"
        for key, plain in (
            ("peft_type", "LORA"),
            ("use_rslora", False),
            ("use_dora", False),
        )
        if saved.get(key, plain) not in (plain, None)
    ]
    own = injected_config(model)  # the patterns PEFT sets itself (a fused gate_up_proj: twice r and alpha)
    unsupported += [
        f"{key} {saved[key]!r}"
        for key in ("rank_pattern", "alpha_pattern")
        if (saved.get(key) or {}) != (getattr(own, key) or {})
    ]
    if unsupported:
        raise UsageError(
            f"--lora-adapter-path {path!r} has {', '.join(unsupported)}: only plain LoRA (one rank and "
            "alpha, scaling alpha / r) is trained here"
        )
    if wrong:
        raise UsageError(
            f"--lora-adapter-path {path!r} was trained with {'; '.join(wrong)}: give the adapter's"
        )
    stored = {(k if k.startswith(PEFT_PREFIX) else PEFT_PREFIX + k): v for k, v in stored.items()}
    wanted = {peft_name(n): (n, tuple(p.shape)) for n, p in model.named_parameters() if is_adapter(n)}
    missing = sorted(set(wanted) - set(stored))
    extra = sorted(set(stored) - set(wanted))
    if missing or extra:
        raise UsageError(
            f"--lora-adapter-path {path!r} does not fit --target-modules {','.join(cfg.target_modules)} "
            f"--target-parameters {','.join(cfg.target_parameters)}: "
            + (f"it lacks {missing[0]}" if missing else f"it has {extra[0]}, which the model's adapters lack")
            + f" ({len(missing)} missing, {len(extra)} extra)"
        )
    out = {}
    for key, (name, shape) in wanted.items():
        if tuple(stored[key].shape) != shape:
            raise UsageError(
                f"--lora-adapter-path {path!r}: {key} is {tuple(stored[key].shape)}, the model's {shape}"
            )
        out[name] = stored[key].float()
    return out


def set_adapters_enabled(model: nn.Module, enabled: bool) -> None:
    """Switch every LoRA layer on or off (off: the base model). PEFT's `enable_adapters(False)`
    would also take the adapters' requires_grad away; FSDP2 fixes a group's gradient dtypes at
    its first forward from the parameters that require grad, so a first forward with the
    adapters off (the reference pass, with --use-rollout-logprobs) would leave mixed precision
    without them. Only the switch PEFT's forward reads is flipped here."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for m in model.modules():
        if isinstance(m, BaseTunerLayer):
            m._disable_adapters = not enabled


def wrapped_parameters(model: nn.Module) -> dict[str, str]:
    """The LoRA modules on parameters rather than linear layers (PEFT's ParamWrapper: fused
    experts, a router) -> the checkpoint name of the parameter each adapts."""
    return {
        module: checkpoint_name(param)
        for module, param in adapted(model).items()
        if hasattr(model.get_submodule(module), "parameter_name")
    }


def merged(
    named: Iterator[tuple[str, torch.Tensor]], scaling: float, targets: dict[str, str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors in `named_parameters` order -> the base model's tensors with each adapter
    merged into the parameter it adapts (`targets`: `adapted`), W + scaling * B A in float32, then
    W's dtype (per expert for fused experts, as PEFT merges), under the checkpoint's names. A LoRA
    module's parameters come base first, then lora_A, lora_B, so one module is held at a time."""
    bases = {param: module for module, param in targets.items()}
    held: dict[str, torch.Tensor] = {}
    for name, t in named:
        m = _ADAPTER_PARAM.match(name)
        if m is None:
            if name in bases:
                held[name] = t
            else:
                yield checkpoint_name(name), t
            continue
        module, which = m.group(1), m.group(2)
        if which == "A":
            held[module + ".A"] = t
            continue
        base_name = targets[module]
        base, a = held.pop(base_name), held.pop(module + ".A")
        delta = peft_experts.delta(a, t, scaling, base.shape)
        yield checkpoint_name(base_name), (base.float() + delta).to(base.dtype)
    assert not held, f"LoRA layers without their adapters: {sorted(held)[:3]}"


def adapter_config_dict(config: Any, base: str) -> dict[str, Any]:
    """The adapter's PEFT config (`injected_config`: the vision tower's layers excluded, the expert
    parameters PEFT wraps) as JSON data (adapter_config.json; SGLang's `config_dict`), so PEFT
    loads it as trained."""
    config = copy.copy(config)
    config.base_model_name_or_path = base
    data = config.to_dict()
    for key, value in data.items():  # PEFT holds module names as sets: JSON lists (not a str of a set)
        if isinstance(value, set):
            data[key] = sorted(value)
    return json.loads(json.dumps(data, default=str))


def full_adapters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every adapter as a full tensor under PEFT's name (collective: each is all-gathered)."""
    return [
        (peft_name(n), (p.full_tensor() if hasattr(p, "full_tensor") else p).detach())
        for n, p in model.named_parameters()
        if is_adapter(n)
    ]
