"""`python -m slime.tinker --model NAME=HF_DIR [--model ...] [--host 127.0.0.1 --port P]`: a
Tinker-compatible service that the official `tinker` SDK reaches with
`ServiceClient(base_url="http://HOST:P")` (or TINKER_BASE_URL) and an API key starting `tml-`.

NAME is what clients pass as `base_model` (e.g. Qwen/Qwen3-0.6B), HF_DIR a local Hugging Face
checkpoint. The server binds loopback unless told otherwise; on another address it needs
`--api-key` (without, it accepts any `tml-` key, fit for one machine). docs/tinker.md.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import sys

from slime.utils.errors import UsageError


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m slime.tinker", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        action="append",
        required=True,
        metavar="NAME=HF_DIR",
        help="a base model clients may name (repeat for several)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="the port (0: a free one, printed)")
    parser.add_argument("--train-backend", default="fsdp", choices=["fsdp"], help="the trainer (FSDP actor)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--train-ranks",
        type=int,
        default=1,
        metavar="N",
        help="FSDP ranks each training model is sharded over: processes on this machine, with --device "
        "cuda one GPU each (default 1)",
    )
    parser.add_argument(
        "--api-key", action="append", default=[], help="an accepted API key (tml-...; repeat for several)"
    )
    parser.add_argument(
        "--lora-alpha", type=int, default=32, help="the adapters' alpha (scaling alpha / rank; default 32)"
    )
    parser.add_argument(
        "--check-precision",
        type=float,
        nargs="?",
        const=1e-4,
        default=None,
        metavar="TOL",
        help="report each step's largest |trainer - sampler| log-prob of the sampled tokens "
        "(sampler_logprob_abs_diff:max) and fail a model's first step above TOL (default 1e-4)",
    )
    parser.add_argument(
        "--store",
        default="tinker-store",
        help="the directory of the tinker:// checkpoints (kept across restarts)",
    )
    parser.add_argument(
        "--session-timeout",
        type=float,
        default=600.0,
        help="seconds without a heartbeat before a session expires",
    )
    return parser.parse_args(argv)


def models(specs: list[str]) -> dict[str, str]:
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--model {spec!r}: give NAME=HF_DIR (e.g. Qwen/Qwen3-0.6B=/models/qwen3)")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise UsageError(
                f"--model {spec!r}: {path!r} holds no config.json (a Hugging Face checkpoint directory)"
            )
        if name in out:
            raise UsageError(f"--model {name!r} is given twice")
        out[name] = os.path.abspath(path)
    return out


def check(args: argparse.Namespace) -> None:
    bad = [k for k in args.api_key if not k.startswith("tml-")]
    if bad:
        raise UsageError(f"--api-key {bad[0]!r}: the Tinker SDK sends only keys that start with tml-")
    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    if not loopback and not args.api_key:
        raise UsageError(f"--host {args.host}: a server off loopback needs --api-key (the keys it accepts)")
    if args.lora_alpha < 1 or args.session_timeout <= 0:
        raise UsageError("--lora-alpha must be >= 1 and --session-timeout > 0")
    if args.train_ranks < 1:
        raise UsageError(f"--train-ranks {args.train_ranks}: give at least 1")
    if args.device == "cuda":
        import torch

        if args.train_ranks > torch.cuda.device_count():
            raise UsageError(
                f"--train-ranks {args.train_ranks} with --device cuda: this machine has "
                f"{torch.cuda.device_count()} GPU(s), one per rank"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        bases = models(args.model)
        check(args)
    except UsageError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(serve(args, bases))
    return 0


async def serve(args: argparse.Namespace, bases: dict[str, str]) -> None:
    """Bind (`--port 0`: a free port), print the ready line with the address, serve until killed."""
    from aiohttp import web

    from slime.tinker.server import make_app
    from slime.tinker.service import Service, ServiceConfig

    config = ServiceConfig(
        bases,
        args.device,
        args.lora_alpha,
        args.session_timeout,
        args.store,
        args.check_precision,
        args.train_ranks,
    )
    service = Service(config)
    runner = web.AppRunner(make_app(service, tuple(args.api_key)), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    # the ready line (stdout, as the engine's): whoever started the server reads its address here
    sys.stdout.write(f"slime.tinker serving {', '.join(bases)} on http://{args.host}:{port}\n")
    sys.stdout.flush()
    # SIGTERM / SIGINT end the serving cleanly: the app's cleanup stops the sampling engines
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
