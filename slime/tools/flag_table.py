"""Print train.py's flags as markdown tables, one per group, with each flag's effect here.

    python -m slime.tools.flag_table            # the section docs/migrating-from-slime.md holds
    python -m slime.tools.flag_table --write    # rewrite that section in place

Generated from the parser itself (slime.config.arguments.build_parser), so the document cannot
drift from the code: a test compares the two. Flags from slime.config.megatron_lm and
slime.config.slime_flags carry their effect per train backend; the FSDP backend's own flags
(slime.config.backends.FSDP_ONLY) are refused with Megatron; every other flag is this project's
own setting, applied as its help says.
"""

from __future__ import annotations

import argparse
import os
import sys

BEGIN, END = "<!-- flag-table:begin (python -m slime.tools.flag_table --write) -->", "<!-- flag-table:end -->"
DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "migrating-from-slime.md")


def _cell(text: str | None) -> str:
    return " ".join((text or "").replace("%%", "%").replace("|", "/").split())


def render() -> str:
    from slime.config.arguments import build_parser
    from slime.config.backends import FSDP_ONLY
    from slime.config.derived import SPECS

    specs = {s.flag: s for s in SPECS}
    parser = build_parser()
    out = []
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.help != argparse.SUPPRESS]
        actions = [a for a in actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        out += [f"#### {group.title}", "", "| flag | fsdp | megatron | here |", "|---|---|---|---|"]
        for a in actions:
            flag = a.option_strings[-1] if len(a.option_strings) > 1 else a.option_strings[0]
            spec = specs.get(flag)
            if spec is not None:
                out.append(f"| `{flag}` | {spec.fsdp} | {spec.megatron} | {_cell(spec.note)} |")
            else:
                backends = ("fsdp",) if flag in FSDP_ONLY else ("fsdp", "megatron")
                cells = " | ".join("applied" if b in backends else "refused" for b in ("fsdp", "megatron"))
                out.append(f"| `{flag}` | {cells} | {_cell(a.help)} |")
        out.append("")
    return "\n".join(out).rstrip("\n") + "\n"


def section(doc: str) -> str:
    """The generated part of the document (between the markers)."""
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    return doc[start:end].strip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write", action="store_true", help="rewrite the section of docs/migrating-from-slime.md")
    args = p.parse_args(argv)
    table = render()
    if not args.write:
        sys.stdout.write(table)
        return 0
    with open(DOC) as f:
        doc = f.read()
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    with open(DOC, "w") as f:
        f.write(doc[:start] + "\n" + table + doc[end:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
