"""`--sglang-<name>`: every SGLang server argument, passed through to the servers slime starts.

The list is read from the installed SGLang (`ServerArgs.add_cli_args`, the function SGLang's own
launcher uses), never kept here: each of its options `--foo` becomes `--sglang-foo` with the same
type, choices, nargs and on/off behaviour, and the values given are turned back into SGLang's
command line (`server_argv`). Only flags that were given are passed; SGLang's defaults apply to
the rest. Options that slime sets itself are refused with the flag that controls them.

SGLang is imported only when `--rollout-backend sglang` or a `--sglang-*` flag is used. Where it
cannot be imported (a CPU machine checking a cluster script), the `--sglang-*` flags given are
passed through as written, with a warning.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

# SGLang option dest -> what sets it in slime.
RESERVED = {
    "model_path": "--hf-checkpoint",
    "tokenizer_path": "--hf-checkpoint",
    "host": "slime (the engine's bundle node)",
    "port": "slime (a free port)",
    "tp_size": "--rollout-num-gpus-per-engine",
    "base_gpu_id": "slime (the engine's Ray bundle)",
    "random_seed": "--seed",
}

# slime's own flags in the --sglang- namespace (an SGLang option of the same name is not mirrored).
OWN_FLAGS = {
    "--sglang-router-ip",
    "--sglang-router-port",
    "--sglang-server-concurrency",
    "--sglang-config",
    "--sglang-router-request-timeout-secs",
    "--sglang-pp-size",
    "--sglang-pipeline-parallel-size",
}

# The SGLang server options the built-in torch engine takes too, with the same meaning
# (slime.engines.torch_engine.cli): with --rollout-backend torch, `--sglang-<name>` of these is
# passed to the torch engines; any other is refused. Value: the choices a value must be in, or
# None (any value, or none for a switch; the engine's own parser checks the rest at start).
TORCH_ENGINE_OPTIONS: dict[str, tuple[str, ...] | None] = {
    "--dtype": ("float32", "bfloat16", "float16"),
    "--max-running-requests": None,
    "--max-prefill-tokens": None,
    "--context-length": None,
    "--disable-cuda-graph": None,
    "--cuda-graph-max-bs": None,
    "--disable-overlap-schedule": None,
    "--num-continuous-decode-steps": None,
    "--enable-torch-compile": None,
    "--torch-compile-max-bs": None,
    # SGLang's own choices hold where SGLang is installed; torch_native is the one both share (the
    # torch engine's padded-key kernels; its default takes the flash kernel where it runs).
    "--attention-backend": ("torch_native",),
}

AddCliArgs = Callable[[argparse.ArgumentParser], None]


def load_server_cli() -> AddCliArgs:
    """The installed SGLang's argument registration (ImportError when SGLang is not installed)."""
    from sglang.srt.server_args import ServerArgs

    return ServerArgs.add_cli_args


def add_sglang_arguments(
    parser: argparse.ArgumentParser, add_cli_args: AddCliArgs
) -> dict[str, tuple[str, str]]:
    """Mirror SGLang's options as `--sglang-<name>` on `parser`. Returns dest -> (SGLang option,
    kind) for `server_argv`; kind is "flag" (no value), "const" or "value"."""
    scratch = argparse.ArgumentParser(add_help=False)
    add_cli_args(scratch)
    group = parser.add_argument_group(
        "SGLang server arguments (passed through; see `python -m sglang.launch_server --help`)"
    )
    mirrored: dict[str, tuple[str, str]] = {}
    for action in scratch._actions:
        long = [o for o in action.option_strings if o.startswith("--")]
        if not long or isinstance(action, argparse._HelpAction):
            continue
        option = long[0]
        if "--sglang-" + option[2:] in OWN_FLAGS:
            continue
        dest = "sglang_" + action.dest
        kwargs: dict[str, Any] = {"dest": dest, "default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
        if isinstance(action, argparse._StoreConstAction | argparse.BooleanOptionalAction):
            # store_true / store_false / store_const: a switch, passed as the bare option.
            kwargs["action"] = "store_const"
            kwargs["const"] = True
            kind = "flag"
        elif action.nargs == 0:
            continue  # other zero-argument actions (version, count) make no sense for a server
        else:
            kwargs.update(
                type=action.type, choices=action.choices, nargs=action.nargs, metavar=action.metavar
            )
            kind = "value"
        group.add_argument("--sglang-" + option[2:], **kwargs)
        mirrored[dest] = (option, kind)
    return mirrored


def server_argv(ns: argparse.Namespace, mirrored: dict[str, tuple[str, str]]) -> list[str]:
    """The SGLang command-line arguments for the `--sglang-*` flags given on the command line."""
    argv: list[str] = []
    for dest, (option, kind) in mirrored.items():
        if not hasattr(ns, dest):
            continue
        value = getattr(ns, dest)
        if kind == "flag" or (kind == "words" and not value):
            argv.append(option)
        elif isinstance(value, list):
            argv += [option, *map(str, value)]
        else:
            argv += [option, str(value)]
    return argv


def torch_engine_problem(argv: list[str]) -> str | None:
    """Why SGLang's arguments `argv` (server_argv's) cannot go to torch engines, or None."""
    for i, arg in enumerate(argv):
        if not arg.startswith("--"):
            continue
        if arg not in TORCH_ENGINE_OPTIONS:
            takes = ", ".join("--sglang-" + o[2:] for o in TORCH_ENGINE_OPTIONS)
            return (
                f"--sglang-{arg[2:]} configures SGLang engines, and --rollout-backend is torch, whose "
                f"engines take only {takes}: drop it (or use --rollout-backend sglang)"
            )
        choices = TORCH_ENGINE_OPTIONS[arg]
        value = argv[i + 1] if i + 1 < len(argv) else None
        if choices is not None and value not in choices:
            return f"--sglang-{arg[2:]} {value}: the torch engine takes {' | '.join(choices)}"
    return None


def reserved_problem(ns: argparse.Namespace, mirrored: dict[str, tuple[str, str]]) -> str | None:
    for sglang_dest, controlled_by in RESERVED.items():
        dest = "sglang_" + sglang_dest
        if dest in mirrored and hasattr(ns, dest):
            return f"--sglang-{mirrored[dest][0][2:]} is set by {controlled_by}; drop it"
    return None


def mirror_sglang_flags(parser: argparse.ArgumentParser, argv: list[str]) -> dict[str, tuple[str, str]]:
    """Add `--sglang-<name>` to `parser` when SGLang is asked for (a `--sglang-*` flag in `argv`,
    or --rollout-backend sglang), reading its argument list from the installed SGLang. Without
    SGLang, the flags given are passed through unchecked (`pass_through`). Returns what
    add_sglang_arguments returns."""
    given = [a.split("=")[0] for a in argv if a.startswith("--sglang-") and a.split("=")[0] not in OWN_FLAGS]
    known, _ = parser.parse_known_args(argv)
    if not given and known.rollout_backend != "sglang":
        return {}
    try:
        add_cli_args = load_server_cli()
    except Exception as e:  # not installed, or not importable on this machine
        if given:
            if known.rollout_backend != "torch":  # torch engines' options are checked at parse
                logger.warning(
                    "SGLang cannot be imported here (%s: %s): %d --sglang-* flag(s) are passed through "
                    "unchecked; SGLang checks them when the engines start",
                    type(e).__name__,
                    e,
                    len(set(given)),
                )
            return pass_through(parser, given)
        return {}  # --rollout-backend sglang with external engines needs no local SGLang
    return add_sglang_arguments(parser, add_cli_args)


def pass_through(parser: argparse.ArgumentParser, given: list[str]) -> dict[str, tuple[str, str]]:
    """Each `--sglang-<name>` given, as an option taking the words up to the next option: none is
    a switch (`--enable-x`), one or more are its values. SGLang's own parser reads them at launch."""
    group = parser.add_argument_group(
        "SGLang server arguments (passed through unchecked: SGLang is not importable)"
    )
    mirrored: dict[str, tuple[str, str]] = {}
    for flag in dict.fromkeys(given):
        dest = "sglang_" + flag[len("--sglang-") :].replace("-", "_")
        group.add_argument(flag, dest=dest, nargs="*", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        mirrored[dest] = ("--" + flag[len("--sglang-") :], "words")
    return mirrored
