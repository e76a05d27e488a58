"""`--sglang-<name>` pass-through, against a stub of SGLang's argument registration (SGLang
itself cannot be imported on this CPU machine; its ServerArgs.add_cli_args has this shape)."""

from __future__ import annotations

import argparse

import pytest

from slime.config import sglang_args
from slime.ray.cli import parse_args


def stub_add_cli_args(parser: argparse.ArgumentParser) -> None:
    """A few options of the kinds SGLang's list has (types, choices, nargs, switches, reserved)."""
    parser.add_argument("--model-path", "--model", type=str, required=True)
    parser.add_argument("--tp-size", "--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--mem-fraction-static", type=float, default=None)
    parser.add_argument(
        "--attention-backend", type=str, choices=["fa3", "flashinfer", "triton"], default=None
    )
    parser.add_argument("--cuda-graph-bs", type=int, nargs="+", default=None)
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    parser.add_argument("--disable-radix-cache", action="store_true")


@pytest.fixture
def base(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setattr(sglang_args, "load_server_cli", lambda: stub_add_cli_args)
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    return [
        "--hf-checkpoint",
        tiny_model,
        "--prompt-data",
        str(data),
        "--rollout-batch-size",
        "1",
        "--num-rollout",
        "1",
        "--rm-type",
        "exact",
        "--rollout-backend",
        "sglang",
        "--rollout-external-engine-addrs",
        "10.0.0.5:30000",
    ]


def test_given_flags_become_sglang_arguments_and_only_those(base):
    config = parse_args(
        [
            *base,
            "--sglang-mem-fraction-static",
            "0.7",
            "--sglang-attention-backend",
            "fa3",
            "--sglang-cuda-graph-bs",
            "1",
            "2",
            "4",
            "--sglang-enable-deterministic-inference",
        ]
    )
    assert config.cluster.sglang_server_args == (
        "--mem-fraction-static",
        "0.7",
        "--attention-backend",
        "fa3",
        "--cuda-graph-bs",
        "1",
        "2",
        "4",
        "--enable-deterministic-inference",
    )
    assert parse_args(base).cluster.sglang_server_args == ()  # SGLang's own defaults otherwise


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--sglang-attention-backend", "sdpa"], "invalid choice: 'sdpa'"),
        (["--sglang-mem-fraction-static", "lots"], "invalid float value: 'lots'"),
        (["--sglang-tp-size", "2"], "--sglang-tp-size is set by --rollout-num-gpus-per-engine"),
        (["--sglang-model-path", "x"], "--sglang-model-path is set by --hf-checkpoint"),
        (["--sglang-no-such-option", "1"], "unrecognized arguments: --sglang-no-such-option"),
    ],
)
def test_bad_sglang_flags_exit_2(base, capsys, extra, message):
    with pytest.raises(SystemExit) as e:
        parse_args([*base, *extra])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_without_sglang_the_flags_pass_through_as_written(tiny_model, tmp_path, capsys, caplog):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = [
        "--hf-checkpoint",
        tiny_model,
        "--prompt-data",
        str(data),
        "--rollout-batch-size",
        "1",
        "--num-rollout",
        "1",
        "--rm-type",
        "exact",
    ]
    given = [
        "--sglang-mem-fraction-static",
        "0.7",
        "--sglang-enable-dp-attention",
        "--sglang-cuda-graph-bs",
        "1",
        "2",
        "4",
        "--sglang-dp-size=2",
        "--sglang-watchdog-timeout",
        "-1",
    ]
    config = parse_args([*base, "--rollout-backend", "sglang", *given])
    assert list(config.cluster.sglang_server_args) == [
        "--mem-fraction-static",
        "0.7",
        "--enable-dp-attention",
        "--cuda-graph-bs",
        "1",
        "2",
        "4",
        "--dp-size",
        "2",
        "--watchdog-timeout",
        "-1",
    ]
    assert "passed through unchecked" in caplog.text
    # Reserved options stay refused, and the torch engine refuses SGLang's flags.
    with pytest.raises(SystemExit) as e:
        parse_args([*base, "--rollout-backend", "sglang", "--sglang-tp-size", "2"])
    assert (
        e.value.code == 2
        and "--sglang-tp-size is set by --rollout-num-gpus-per-engine" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit) as e:
        parse_args([*base, "--rollout-backend", "torch", "--sglang-mem-fraction-static", "0.7"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "--sglang-mem-fraction-static configures SGLang engines" in err


def test_the_torch_engine_takes_the_sglang_options_it_shares(tiny_model, tmp_path, capsys):
    """With --rollout-backend torch, `--sglang-<name>` of an option the torch engine has too (its
    dtype, batch, CUDA graphs, decode rounds) reaches its command line; a value it has no choice
    for is refused at parse, naming the flag."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    base = [
        "--hf-checkpoint",
        tiny_model,
        "--prompt-data",
        str(data),
        "--rollout-batch-size",
        "1",
        "--num-rollout",
        "1",
        "--rm-type",
        "exact",
        "--rollout-backend",
        "torch",
    ]
    given = [
        "--sglang-dtype",
        "bfloat16",
        "--sglang-max-running-requests",
        "512",
        "--sglang-num-continuous-decode-steps",
        "4",
        "--sglang-disable-overlap-schedule",
        "--sglang-attention-backend",
        "torch_native",
        "--sglang-enable-torch-compile",
        "--sglang-torch-compile-max-bs",
        "64",
    ]
    config = parse_args([*base, *given])
    assert list(config.cluster.sglang_server_args) == [
        "--dtype",
        "bfloat16",
        "--max-running-requests",
        "512",
        "--num-continuous-decode-steps",
        "4",
        "--disable-overlap-schedule",
        "--attention-backend",
        "torch_native",
        "--enable-torch-compile",
        "--torch-compile-max-bs",
        "64",
    ]
    for flag, value, message in (
        ("--sglang-dtype", "auto", "the torch engine takes float32 | bfloat16"),
        ("--sglang-attention-backend", "fa3", "the torch engine takes torch_native"),
    ):
        with pytest.raises(SystemExit) as e:
            parse_args([*base, flag, value])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"{flag} {value}: {message}" in err
