"""slime.config.flags: a flag declared once, on the config field it fills, makes both the parser's
argument and the record's value."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass

import pytest

from slime.config.arguments import build_parser
from slime.config.debug import DebugConfig
from slime.config.flags import NO_UNSET, add_flags, flag, flags_of, from_flags
from slime.config.loss import LossConfig
from slime.config.records import (
    AsyncConfig,
    BridgeConfig,
    CheckpointConfig,
    ClusterConfig,
    LoggingConfig,
    RolloutConfig,
)
from slime.config.rollout import DataConfig, SamplingConfig
from slime.config.train import BatchConfig, FSDPConfig, MegatronConfig, OptimizerConfig, TrainConfig

RECORDS = (
    TrainConfig,
    LossConfig,
    OptimizerConfig,
    BatchConfig,
    FSDPConfig,
    MegatronConfig,
    AsyncConfig,
    CheckpointConfig,
    DebugConfig,
    LoggingConfig,
    DataConfig,
    SamplingConfig,
    RolloutConfig,
    ClusterConfig,
    BridgeConfig,
)


@dataclass(frozen=True)
class Toy:
    rate: float = flag("--toy-rate", 0.5, help="a rate")
    steps: int | None = flag("--toy-steps", None, type=int)
    on: bool = flag("--toy-on", False)
    kept: bool = flag("--toy-no-keep", True, dest="toy_keep", action="store_false")
    stops: tuple[str, ...] = flag("--toy-stop", [], nargs="*")
    unflagged: str = "x"


def test_one_field_makes_the_argument_and_takes_its_value():
    parser = argparse.ArgumentParser()
    add_flags(parser, Toy, "toy")
    assert from_flags(Toy, parser.parse_args([])) == Toy()
    ns = parser.parse_args(
        ["--toy-rate", "2", "--toy-steps", "3", "--toy-on", "--toy-no-keep", "--toy-stop", "a", "b"]
    )
    assert from_flags(Toy, ns, unflagged="y") == Toy(2.0, 3, True, False, ("a", "b"), "y")
    with pytest.raises(SystemExit):  # the type comes from the default: an int flag refuses a word
        parser.parse_args(["--toy-steps", "three"])
    # A field without a flag takes the namespace's attribute of its name (a flag declared elsewhere).
    assert from_flags(Toy, argparse.Namespace(unflagged="z")).unflagged == "z"


def test_the_parsers_defaults_are_the_records_defaults():
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions}
    for record in RECORDS:
        for f, spec in flags_of(record):
            action = actions[spec.dest]
            assert spec.name in action.option_strings, (record.__name__, f.name)
            default = f.default if spec.unset is NO_UNSET else spec.unset  # `auto`, None: decided later
            default = list(default) if isinstance(default, tuple) else default
            if default is not MISSING:  # a required field (--hf-checkpoint) has none
                assert action.default == default, (record.__name__, f.name, action.default, default)


def test_a_flag_reaches_its_field_through_parse():
    from slime.config.arguments import parse

    parsed = parse(
        [
            "--hf-checkpoint",
            "m",
            "--rm-type",
            "math",
            "--prompt-data",
            "p.jsonl",
            "--rollout-batch-size",
            "2",
            "--num-rollout",
            "1",
            "--lr",
            "0.5",
            "--fsdp-param-dtype",
            "bfloat16",
            "--eps-clip-high",
            "0.3",
            "--device",
            "cpu",
        ]
    )
    ns = parsed.ns
    assert (ns.lr, ns.fsdp_param_dtype, ns.eps_clip_high) == (0.5, "bfloat16", 0.3)
    train = from_flags(
        TrainConfig,
        ns,
        device="cpu",
        loss=from_flags(LossConfig, ns),
        optimizer=from_flags(OptimizerConfig, ns),
        fsdp=from_flags(FSDPConfig, ns),
    )
    assert (train.optimizer.lr, train.fsdp.param_dtype, train.loss.eps_clip_high) == (0.5, "bfloat16", 0.3)


def test_a_bad_value_is_a_problem_for_parse_and_exit_code_2_on_the_command_line(capsys):
    from slime.config.arguments import parse
    from slime.ray.cli import parse_args

    for bad, why in (
        (["--loss-type", "bogus"], "invalid choice: 'bogus'"),
        (["--lr", "abc"], "invalid float value"),
    ):
        parsed = parse(["--hf-checkpoint", "m", *bad])  # never exits
        assert parsed.config is None and why in parsed.problems[0]
        with pytest.raises(SystemExit) as e:
            parse_args(["--hf-checkpoint", "m", *bad])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("usage: train.py") and why in err


def test_a_flag_decided_later_keeps_its_own_default_and_the_record_its():
    @dataclass(frozen=True)
    class Later:
        gpus: int = flag("--later-gpus", 1, unset=None)
        backend: str = flag("--later-backend", "fsdp", unset="auto", choices=["auto", "fsdp"])

    parser = argparse.ArgumentParser()
    add_flags(parser, Later, "later")
    ns = parser.parse_args([])
    assert (ns.later_gpus, ns.later_backend) == (None, "auto")  # code can tell "not given"
    assert from_flags(Later, ns) == Later()  # still undecided: the record's defaults
    ns.later_gpus, ns.later_backend = 4, "fsdp"  # what resolution decided
    assert from_flags(Later, ns) == Later(4, "fsdp")
    assert parser.parse_args(["--later-gpus", "2"]).later_gpus == 2  # the type from the record's default


@dataclass(frozen=True)
class Documented:
    rate: float = flag("--doc-rate", 0.5)
    """`--doc-rate R`: how fast, in
    % per step."""
    size: int = flag("--doc-size", 1, help="the help= text")
    """A docstring the help= text wins over."""
    named: int = flag("--doc-named", 1)
    """`--doc-named`."""


def test_a_fields_docstring_is_its_help_text():
    parser = argparse.ArgumentParser()
    add_flags(parser, Documented, "doc")
    helps = {a.option_strings[0]: a.help for a in parser._actions if a.option_strings}
    assert helps["--doc-rate"] == "how fast, in %% per step."  # one paragraph, % escaped for argparse
    assert helps["--doc-size"] == "the help= text"
    assert helps["--doc-named"] is None  # only its own name: nothing said
    assert "how fast, in % per step." in parser.format_help()


def test_every_flag_of_train_py_says_what_it_does():
    parser = build_parser()
    silent = [a.option_strings[0] for a in parser._actions if a.option_strings and not (a.help or "").strip()]
    assert silent == [], "give these flags a docstring on their field (or help=)"


def test_the_lora_flags_name_the_constants_they_describe():
    """Two docstrings spell out a constant (a docstring is no f-string): they must say its value."""
    from slime.config.lora import ADAPTER_NAME, ALL_LINEAR

    helps = {a.option_strings[0]: a.help for a in build_parser()._actions if a.option_strings}
    assert ALL_LINEAR in helps["--target-modules"] and repr(ADAPTER_NAME) in helps["--lora-push"]
