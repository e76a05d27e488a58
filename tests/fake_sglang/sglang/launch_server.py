"""`python -m sglang.launch_server` of the test stand-in: SGLang's command line, slime's torch
engine behind it (tensor-parallel size 1, CPU)."""

from __future__ import annotations

import argparse
import json
import os
import sys

from sglang.srt.server_args import ServerArgs


def merge_config(argv: list[str]) -> list[str]:
    """As SGLang's prepare_server_args: the options of the YAML file after `--config` come
    first, so that the command line wins."""
    if "--config" not in argv:
        return argv
    i = argv.index("--config")
    import yaml

    with open(argv[i + 1]) as f:
        config = yaml.safe_load(f) or {}
    from_file = [item for key, value in config.items() for item in (f"--{key}", str(value))]
    return from_file + argv[:i] + argv[i + 2 :]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m sglang.launch_server")
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(merge_config(argv))
    # SGLang logs its whole configuration, API key included: so does the stand-in.
    print(f"server_args={vars(args)}", file=sys.stderr, flush=True)
    record = os.environ.get("FAKE_SGLANG_RECORD")
    if record:
        with open(record, "a") as f:
            f.write(
                json.dumps(
                    {
                        "argv": argv,
                        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                        "pid": os.getpid(),
                    }
                )
                + "\n"
            )
    if args.tp_size != 1:
        print(
            f"the stand-in serves tensor-parallel size 1 only, not --tp-size {args.tp_size}", file=sys.stderr
        )
        return 1
    from slime.engines.protocol import API_KEY_ENV
    from slime.engines.torch_engine.cli import main as torch_engine

    if args.api_key:
        os.environ[API_KEY_ENV] = args.api_key

    engine_argv = [
        "--model-path",
        args.model_path,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--weight-version",
        args.weight_version,
        "--num-threads",
        "1",
        "--device",
        "cpu",
    ]
    if args.random_seed is not None:
        engine_argv += ["--random-seed", str(args.random_seed)]
    if args.enable_deterministic_inference:
        engine_argv.append("--enable-deterministic-inference")
    return torch_engine(engine_argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
