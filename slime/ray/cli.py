"""train.py's command line: the flags (slime.config.arguments.parse), then the one validation
pass in which each component checks what it alone knows, then --dry-run or exit code 2.

The flags' own rules are the config layer's; a component's check needs that component's code:
the Megatron actor's layouts against the model (slime.backends.megatron.settings). The inputs a
job reads (checkpoints, data, functions, a router) are checked by the driver before Ray starts
(slime.ray.inputs), and by --dry-run here.
"""

from __future__ import annotations

import argparse
import sys

from slime.config.arguments import Config, parse


def component_problems(ns: argparse.Namespace) -> list[str]:
    """What each component finds wrong with flags that passed the config layer's rules."""
    if getattr(ns, "train_backend", None) != "megatron":
        return []
    from slime.backends.megatron.settings import layout_problem

    problem = layout_problem(ns)
    return [problem] if problem else []


def parse_args(argv: list[str] | None = None) -> Config:
    """The validated config of `argv` (default: sys.argv). Any problem exits with code 2 and one
    message naming the flag; with --dry-run every problem is listed, or the plan printed, and the
    process exits."""
    parsed = parse(argv)
    found = parsed.problems
    if not found or parsed.ns.dry_run:
        found = list(dict.fromkeys([*found, *component_problems(parsed.ns)]))
    if parsed.ns.dry_run and hasattr(parsed.ns, "hf_checkpoint"):
        from slime.ray.dry_run import dry_run

        sys.exit(dry_run(parsed.ns, parsed.config, found, parsed.resolution))
    if found:
        argparse.ArgumentParser.error(parsed.parser, found[0])  # usage and the message, exit code 2
    assert parsed.config is not None
    return parsed.config
