"""The stand-in's argument list: the options slime sets on every launch, and a few of the kinds
SGLang's own list has (value, choices, nargs, switch) for the `--sglang-*` pass-through."""

from __future__ import annotations

import argparse


class ServerArgs:
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--model-path", "--model", type=str, required=True)
        parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
        parser.add_argument("--host", type=str, default="127.0.0.1")
        parser.add_argument("--port", type=int, default=30000)
        parser.add_argument("--nccl-port", type=int, default=None)
        parser.add_argument("--base-gpu-id", type=int, default=0)
        parser.add_argument("--random-seed", type=int, default=None)
        parser.add_argument("--weight-version", type=str, default="default")
        parser.add_argument("--enable-deterministic-inference", action="store_true")
        parser.add_argument("--enable-memory-saver", action="store_true")
        parser.add_argument("--mem-fraction-static", type=float, default=None)
        parser.add_argument(
            "--attention-backend", type=str, choices=["fa3", "flashinfer", "triton"], default=None
        )
        parser.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None)
        parser.add_argument("--disable-radix-cache", action="store_true")
        parser.add_argument("--api-key", type=str, default=None)
        parser.add_argument("--config", type=str, default=None)
