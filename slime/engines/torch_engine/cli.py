"""Command line of the torch engine server.

    python -m slime.engines.torch_engine --model-path DIR [--host 127.0.0.1] [--port 0]
        [--device cpu|cuda] [--dtype float32|bfloat16] [--max-running-requests N]
        [--api-key KEY] [--debug-dump-dir DIR] [--random-seed S]

When the server accepts connections it prints one JSON line on stdout,
`{"event": "ready", "url": "http://HOST:PORT", "pid": N}`; logs go to stderr.

The API key is read from the environment variable SLIME_ENGINE_API_KEY when --api-key is not
given: a command line is readable by every user of the machine (/proc/<pid>/cmdline), an
environment only by the process's own. The key is never logged.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import sys
from typing import Any

from aiohttp import web

from slime.engines.protocol import API_KEY_ENV, check_api_key
from slime.utils.logging_utils import configure_logging

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m slime.engines.torch_engine",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _server_flags(p.add_argument_group("server"))
    _scheduling_flags(p.add_argument_group("scheduling"))
    _requests_and_their_outputs_flags(p.add_argument_group("requests and their outputs"))
    _lora_adapters_flags(p.add_argument_group("LoRA adapters"))
    _cuda_flags(p.add_argument_group("CUDA"))
    return p


def _server_flags(g: Any) -> None:
    g.add_argument("--model-path", required=True, help="local Hugging Face checkpoint directory")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    g.add_argument("--port", type=int, default=0, help="TCP port; 0 lets the OS pick a free one")
    g.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    g.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default="float32",
        help="parameter dtype; float32 on CPU (bf16 is emulated there and drifts)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health* (as SGLang's flag); "
        f"prefer the {API_KEY_ENV} environment variable, which other users cannot read",
    )
    g.add_argument(
        "--debug-dump-dir",
        default=None,
        help="the directory /slime/dump_parameters may write under (paths outside it are refused "
        "with 403); without it the route is refused",
    )
    g.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's choice)")
    g.add_argument(
        "--parent-pid",
        type=int,
        default=None,
        metavar="PID",
        help="shut down cleanly when process PID exits, however it ends (a server that starts engines "
        "of its own passes its pid: a SIGKILL of it leaves no engine behind)",
    )


def _scheduling_flags(g: Any) -> None:
    g.add_argument("--max-running-requests", type=int, default=64, help="most sequences decoding at once")
    g.add_argument("--max-prefill-tokens", type=int, default=8192, help="padded token budget of one prefill")
    g.add_argument("--context-length", type=int, default=None, help="default: model max_position_embeddings")
    g.add_argument(
        "--num-continuous-decode-steps",
        type=int,
        default=1,
        help="most decode steps launched per host round trip, their tokens brought down in one "
        "copy; requests that arrive meanwhile wait for the round to end (SGLang's flag; default 1)",
    )
    g.add_argument(
        "--disable-overlap-schedule",
        action="store_true",
        help="on CUDA, book each decode step before launching the next (SGLang's flag)",
    )


def _requests_and_their_outputs_flags(g: Any) -> None:
    g.add_argument("--random-seed", type=int, default=0, help="seed for requests without sampling_seed")
    g.add_argument("--weight-version", default="default", help="weight_version reported before any update")
    g.add_argument(
        "--max-top-logprobs-num",
        type=int,
        default=20,
        help="largest top_logprobs_num (and OpenAI logprobs) a request may ask for",
    )
    g.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="let requests ask for the experts each token was routed to ('return_routed_experts'; "
        "mixture-of-experts models; SGLang's flag of the same name)",
    )
    g.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant forwards: a request with a sampling_seed gets the same tokens and "
        "log-probs whatever else the engine runs (slower; SGLang's flag of the same name)",
    )


def _lora_adapters_flags(g: Any) -> None:
    g.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters: /load_lora_adapter, /load_lora_adapter_from_tensors, /unload_lora_adapter "
        "and the 'lora_path' field of /generate (SGLang's flag)",
    )
    g.add_argument(
        "--max-loaded-loras",
        type=int,
        default=None,
        help="most LoRA adapters loaded at once (SGLang's flag; default: no limit)",
    )
    g.add_argument(
        "--lora-paths",
        nargs="*",
        default=[],
        metavar="[NAME=]PATH",
        help="PEFT adapter directories to load at start, each named NAME or by its path (SGLang's flag; "
        "implies --enable-lora)",
    )


def _cuda_flags(g: Any) -> None:
    g.add_argument(
        "--disable-cuda-graph",
        action="store_true",
        help="on CUDA, run every decode step eagerly instead of replaying CUDA graphs (SGLang's flag)",
    )
    g.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="largest decode batch replayed as a CUDA graph (SGLang's flag; default: "
        "--max-running-requests; 0: none)",
    )
    g.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="compile the decode step with torch.compile (Inductor fuses each layer's small kernels); "
        "the first steps take seconds to minutes to compile (SGLang's flag)",
    )
    g.add_argument(
        "--torch-compile-max-bs",
        type=int,
        default=32,
        help="largest decode batch run compiled, with --enable-torch-compile (SGLang's flag and default)",
    )
    g.add_argument(
        "--attention-backend",
        choices=["auto", "flash", "torch_native"],
        default="auto",
        help="decode attention: flash reads only each sequence's live keys (torch's flash kernel: CUDA, "
        "bfloat16/float16, Ampere or newer); torch_native attends over keys padded to the longest; "
        "auto: flash where it runs (SGLang's flag, our choices)",
    )


def validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if not os.path.isdir(args.model_path) or not os.path.isfile(os.path.join(args.model_path, "config.json")):
        parser.error(
            f"--model-path {args.model_path!r} is not a Hugging Face checkpoint directory "
            "(no config.json); make one with `python -m slime.tools.make_tiny_model --out DIR`"
        )
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port} must be in [0, 65535]")
    if args.max_running_requests < 1:
        parser.error("--max-running-requests must be >= 1")
    if args.cuda_graph_max_bs is not None and args.cuda_graph_max_bs < 0:
        parser.error(f"--cuda-graph-max-bs {args.cuda_graph_max_bs} must be >= 0 (0: no CUDA graphs)")
    if args.torch_compile_max_bs < 1:
        parser.error(f"--torch-compile-max-bs {args.torch_compile_max_bs} must be >= 1")
    if args.num_continuous_decode_steps < 1:
        parser.error(f"--num-continuous-decode-steps {args.num_continuous_decode_steps} must be >= 1")
    if args.max_prefill_tokens < 1:
        parser.error("--max-prefill-tokens must be >= 1")
    if args.max_top_logprobs_num < 0:
        parser.error("--max-top-logprobs-num must be >= 0")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda but torch sees no CUDA device; use --device cpu")
    elif args.device != "cpu":
        parser.error(f"--device {args.device!r}: use cpu or cuda[:N]")
    if args.api_key is not None:
        try:
            check_api_key(args.api_key)
        except ValueError as e:
            parser.error(f"--api-key / {API_KEY_ENV}: {e}")
    if args.max_loaded_loras is not None and args.max_loaded_loras < 1:
        parser.error("--max-loaded-loras must be >= 1")
    for name, path in _lora_paths(args.lora_paths):
        if not name or not os.path.isfile(os.path.join(path, "adapter_config.json")):
            parser.error(
                f"--lora-paths {name}={path}: PATH must be a PEFT adapter directory (adapter_config.json)"
            )
    if args.debug_dump_dir is not None and not args.debug_dump_dir:
        parser.error("--debug-dump-dir must name a directory")


def _lora_paths(specs: list[str]) -> tuple[tuple[str, str], ...]:
    """SGLang's `--lora-paths` entries, NAME=PATH or PATH (named by its path)."""
    return tuple((s.split("=", 1)[0], s.split("=", 1)[1]) if "=" in s else (s, s) for s in specs)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


async def serve(args: argparse.Namespace) -> None:
    from slime.engines.torch_engine.engine import EngineConfig, TorchEngine
    from slime.engines.torch_engine.server import make_app

    config = EngineConfig(
        model_path=args.model_path,
        device=args.device,
        dtype=args.dtype,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        context_length=args.context_length,
        random_seed=args.random_seed,
        weight_version=args.weight_version,
        num_threads=args.num_threads,
        max_top_logprobs_num=args.max_top_logprobs_num,
        deterministic=args.enable_deterministic_inference,
        disable_cuda_graph=args.disable_cuda_graph,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        overlap_schedule=False if args.disable_overlap_schedule else None,
        num_continuous_decode_steps=args.num_continuous_decode_steps,
        attention_backend=args.attention_backend,
        enable_torch_compile=args.enable_torch_compile,
        torch_compile_max_bs=args.torch_compile_max_bs,
        enable_return_routed_experts=args.enable_return_routed_experts,
        enable_lora=args.enable_lora or bool(args.lora_paths),
        max_loaded_loras=args.max_loaded_loras,
        lora_paths=_lora_paths(args.lora_paths),
    )
    engine = TorchEngine(config)
    engine.start()
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its requests.
    app = make_app(engine, args.api_key, args.debug_dump_dir)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    sock = bind_socket(args.host, args.port)
    await web.SockSite(runner, sock).start()
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    url = f"http://{url_host}:{port}"
    compiled = getattr(engine.runner, "compiled", None)
    logger.info(
        "torch engine %s ready at %s (%s, %s, %d running at most, %s, decode rounds of up to %d step(s)%s%s; "
        "API key %s, parameter dumps %s)",
        args.model_path,
        url,
        type(engine.runner).__name__,
        args.dtype,
        args.max_running_requests,
        engine.runner.stats().get("decode_attention", "transformers' attention"),
        args.num_continuous_decode_steps,
        ", overlapped" if engine.rounds is not None and engine.rounds.overlap else "",
        f", torch.compile up to {compiled.max_bs} rows" if compiled is not None else "",
        "required" if args.api_key else "off",
        f"under {os.path.realpath(args.debug_dump_dir)}" if args.debug_dump_dir else "off",
    )
    sys.stdout.write(json.dumps({"event": "ready", "url": url, "pid": os.getpid()}) + "\n")
    sys.stdout.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watcher = _watch_parent(args.parent_pid, stop) if args.parent_pid else None
    await stop.wait()
    if watcher is not None:
        watcher.cancel()
    logger.info("shutting down")
    await runner.cleanup()
    engine.shutdown()


def _watch_parent(pid: int, stop: asyncio.Event) -> asyncio.Task[None]:
    """Set `stop` when process `pid` exits: its pidfd becomes readable (Linux), else a check
    every second where pidfds are missing."""

    async def watch() -> None:
        loop = asyncio.get_running_loop()
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            fd = None
        except (AttributeError, OSError):  # no pidfd here: poll
            while _alive(pid):
                await asyncio.sleep(1.0)
            fd = None
        if fd is not None:
            gone = asyncio.Event()
            loop.add_reader(fd, gone.set)
            try:
                await gone.wait()
            finally:
                loop.remove_reader(fd)
                os.close(fd)
        logger.info("the parent process %d exited", pid)
        stop.set()

    return asyncio.get_running_loop().create_task(watch())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Taken out of the environment, so that no process this one starts inherits it.
    env_key = os.environ.pop(API_KEY_ENV, None)
    if args.api_key is None and env_key:
        args.api_key = env_key
    validate(args, parser)
    configure_logging(f"engine pid={os.getpid()}")
    asyncio.run(serve(args))
    return 0
