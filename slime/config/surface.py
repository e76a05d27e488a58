"""The flags slime's launch scripts bring that are not this project's own settings, each with an
explicit effect per train backend (slime.config.megatron_lm: Megatron-LM's; slime.config.
slime_flags: slime's features not built here).

    checked    an architecture flag compared with --hf-checkpoint's config.json
    applied    the backend does what the flag says
    no effect  a speed or memory knob the backend has no counterpart for; it cannot change results
    refused    it asks for something not built here: exit 2 naming the feature

The effects are written into `--help`, the start-up banner lists the no-effect flags given, and
docs/migrating-from-slime.md's flag table is slime.tools.flag_table's (a test keeps the two equal).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

CHECKED, APPLIED, NO_EFFECT, REFUSED = "checked", "applied", "no effect", "refused"


@dataclass(frozen=True)
class Spec:
    """One flag: its argparse form, its effect with each train backend and what it does here."""

    flag: str
    kwargs: dict[str, Any]
    fsdp: str
    megatron: str
    note: str
    neutral: Any = None
    """A value that asks for nothing, accepted even where the flag is refused
    (`--expert-tensor-parallel-size 1` in a dense model's script); a tuple: any of its values."""
    group: str = "training"
    refused_note: str | None = None
    """Why the flag is refused, where only one backend refuses it (the note says what it does in
    the other)."""

    @property
    def dest(self) -> str:
        return self.kwargs.get("dest") or self.flag[2:].replace("-", "_")

    def effect(self, backend: str) -> str:
        return self.megatron if backend == "megatron" else self.fsdp

    def help(self) -> str:
        if self.fsdp == self.megatron:
            head = "no effect in this backend" if self.fsdp == NO_EFFECT else self.fsdp
        else:
            head = f"fsdp: {self.fsdp}, megatron: {self.megatron}"
        refused = f" ({self.refused_note})" if self.refused_note else ""
        return f"{head}: {self.note}{refused}".replace("%", "%%")


def store_true(**kw: Any) -> dict[str, Any]:
    return {"action": "store_true", "default": False, **kw}


def add_specs(parser: argparse.ArgumentParser, specs: tuple[Spec, ...], groups: dict[str, str]) -> None:
    made = {key: parser.add_argument_group(title) for key, title in groups.items()}
    for spec in specs:
        kwargs = {"default": None, **spec.kwargs, "help": spec.help()}
        made[spec.group].add_argument(spec.flag, **kwargs)


def given(ns: argparse.Namespace, spec: Spec) -> bool:
    value = getattr(ns, spec.dest)
    return value is not None and value is not False and value != spec.kwargs.get("default")


def _shown(value: Any) -> str:
    if value is True:
        return ""
    return " " + (" ".join(map(str, value)) if isinstance(value, list) else str(value))


def refused_problems(ns: argparse.Namespace, specs: tuple[Spec, ...], backend: str) -> list[str]:
    """One message per refused flag given with a value that asks for something."""
    out = []
    for spec in specs:
        if spec.effect(backend) != REFUSED or not given(ns, spec):
            continue
        value = getattr(ns, spec.dest)
        if is_neutral(spec, value):
            continue
        out.append(f"{spec.flag}{_shown(value)}: {spec.refused_note or spec.note}")
    return out


def no_effect_given(ns: argparse.Namespace, specs: tuple[Spec, ...], backend: str) -> list[str]:
    """The no-effect flags given with a value that asks for something, for the banner."""
    return [
        s.flag
        for s in specs
        if s.effect(backend) == NO_EFFECT and given(ns, s) and not is_neutral(s, getattr(ns, s.dest))
    ]


def is_neutral(spec: Spec, value: Any) -> bool:
    if isinstance(spec.neutral, tuple):
        return value in spec.neutral
    return spec.neutral is not None and value == spec.neutral
