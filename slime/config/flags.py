"""Each flag declared once: on the config field it fills.

    @dataclass(frozen=True)
    class OptimizerConfig:
        lr: float = flag("--lr", 1e-6)
        \"\"\"The peak learning rate.\"\"\"

`flag(...)` is a dataclass field whose default is the flag's default and whose metadata is the
flag (its name, help and any argparse option the field's default does not imply). The parser is
built from the records (`add_flags`: one argument group per record, in field order) and the
records from the parsed namespace (`from_flags`), so adding a flag is one field in one record,
plus the code that reads it. A field without a flag is set by the code that builds the record.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import re
import textwrap
from dataclasses import MISSING, dataclass, field
from typing import Any, TypeVar

R = TypeVar("R")


class _NoUnset:
    """`Flag.unset` when the flag's default is the field's (MISSING cannot be a field's default)."""

    def __repr__(self) -> str:
        return "NO_UNSET"


NO_UNSET: Any = _NoUnset()


@dataclass(frozen=True)
class Flag:
    name: str
    """`--lr`."""
    help: str | None
    options: dict[str, Any]
    """argparse options beyond what the default implies (choices, nargs, metavar, a type for a
    None default, `action="store_false"` with a `dest`)."""
    group: str | None = None
    """The --help group, where it is not the record's."""
    unset: Any = NO_UNSET
    """The flag's own default where the record's is decided from other flags (`auto`, None): a
    value code fills in before the record is built (slime.config.derived, slime.config.resolve)."""

    @property
    def dest(self) -> str:
        return str(self.options.get("dest") or self.name[2:].replace("-", "_"))


def flag(
    name: str,
    default: Any = MISSING,
    *,
    help: str | None = None,
    group: str | None = None,
    unset: Any = NO_UNSET,
    **options: Any,
) -> Any:
    """A dataclass field filled by flag `name`; `default` is the field's and the flag's default
    (a list default is the flag's, the field holds a tuple), unless `unset` gives the flag one of
    its own; `group`: its --help group, where it is not the record's."""
    meta = {"flag": Flag(name, help, options, group, unset)}
    if isinstance(default, list):
        return field(default=tuple(default), metadata=meta)
    return field(default=default, metadata=meta)


def flags_of(cls: type) -> list[tuple[dataclasses.Field[Any], Flag]]:
    """The record's fields that a flag fills, in declaration order."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(cls) if "flag" in f.metadata]


def flag_name(cls: type, field_name: str) -> str:
    """The flag that fills field `field_name` of record `cls` (`--rollout-top-p`)."""
    return str(cls.__dataclass_fields__[field_name].metadata["flag"].name)  # type: ignore[attr-defined]


def _argparse_options(f: dataclasses.Field[Any], spec: Flag) -> dict[str, Any]:
    """argparse's options for the flag: the field's default (or `unset`) as the flag's, and the
    action or type that default implies (a bool: store_true; an int or float: its type)."""
    options = dict(spec.options)
    implied = None if f.default is MISSING else f.default
    default = implied if spec.unset is NO_UNSET else spec.unset
    if options.get("action") in ("store_true", "store_false"):
        return {"default": default, **options}
    if isinstance(implied, bool):
        return {"action": "store_true", "default": default, **options}
    if isinstance(default, tuple):  # nargs flags: argparse hands back a list
        default = list(default)
    if isinstance(implied, (int, float)) and "type" not in options:
        options["type"] = type(implied)
    return {"default": default, **options}


def add_flags(parser: argparse.ArgumentParser, cls: type, title: str) -> dict[str, Any]:
    """The flags of record `cls` on `parser`, in field order, in the argument group `title` (or
    the field's own group); returns the groups by title, for flags that fill no field there
    (an `auto` to resolve, a default decided from other flags). A title met before (another
    record's, in `parser`'s earlier calls) is the same group."""
    groups: dict[str, Any] = {g.title: g for g in parser._action_groups if g.title}

    def group(where: str) -> Any:
        if where not in groups:
            groups[where] = parser.add_argument_group(where)
        return groups[where]

    made = {title: group(title)}
    docs = field_docs(cls)
    for f, spec in flags_of(cls):
        where = spec.group or title
        made[where] = group(where)
        options = _argparse_options(f, spec)
        text = spec.help if spec.help is not None else help_text(docs.get(f.name, ""))
        if text:
            options["help"] = text
        made[where].add_argument(spec.name, **options)
    return made


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstrings of `cls`'s fields (the string under each annotated field in its source), by
    field name; {} where the source cannot be read."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    docs = {}
    for node, after in itertools.pairwise(body):
        text = (
            after.value.value
            if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
            else None
        )
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(text, str):
            docs[node.target.id] = text
    return docs


FLAG_PREFIX = re.compile(r"^`--[\w/-]+(?: [^`]*)?`(?: \([^)]*\))?(?:: |\.$)")
"""A docstring's "`--flag ARG`: " (or "`--flag` (or ENV): ", "`--a/--b`: ") before what it says
the flag does; a docstring that is only the flag's name says nothing."""


def help_text(doc: str) -> str:
    """A field's docstring as --help shows it: one paragraph, without the flag's own name in
    front, `%` escaped for argparse."""
    text = " ".join(doc.split())
    return FLAG_PREFIX.sub("", text, count=1).replace("%", "%%")


def from_flags(cls: type[R], ns: argparse.Namespace, **values: Any) -> R:
    """Record `cls` from the parsed flags. A field with a flag takes the flag's value; one without
    takes the namespace's attribute of its own name where there is one (a flag of Megatron-LM's
    or slime's table, slime.config.surface, whose meaning the record holds); `values` set or
    override fields. What `ns` lacks keeps the field's default (a parser of some flags only)."""
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        spec = f.metadata.get("flag")
        dest = spec.dest if spec is not None else f.name
        if f.init and hasattr(ns, dest):
            value = getattr(ns, dest)
            if spec is not None and spec.unset is not NO_UNSET and value == spec.unset:
                continue  # never decided: the record's default
            kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    kwargs.update(values)
    return cls(**kwargs)
