"""The command line of train.py / train_async.py: slime's flags → typed, validated configs
(the records in slime.config.records, re-exported here).

`parse(argv)` returns a `Config` whose parts go to their components (the train actor gets
`config.train` and nothing else), and every problem with the flags, one line each naming the
flag and the fix; it never exits. The command line's `parse_args` (slime.ray.cli) adds the
components' own checks and --dry-run, and turns a problem into exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, NoReturn

from slime.config import megatron_lm, slime_flags
from slime.config.checks import config_problems
from slime.config.critic import add_critic_arguments, critic_config
from slime.config.debug import TOLERANCES, DebugConfig, lower_precision
from slime.config.derived import custom_config, flag_problems, no_effect_lines
from slime.config.eval_sets import eval_datasets
from slime.config.flags import add_flags, flag_name, from_flags
from slime.config.lora import add_lora_arguments
from slime.config.model_checks import model_problems
from slime.config.opd import add_opd_arguments, opd_config
from slime.config.records import (
    PAUSE_MODES,
    STALE_ACTIONS,
    AsyncConfig,
    BridgeConfig,
    CheckpointConfig,
    ClusterConfig,
    Config,
    EvalConfig,
    LoggingConfig,
    RolloutConfig,
)
from slime.config.resolve import Resolution, resolve
from slime.config.rollout import DataConfig, SamplingConfig
from slime.config.sglang_args import mirror_sglang_flags
from slime.config.surface import add_specs
from slime.config.train import TrainConfig, add_train_arguments, train_config_from_args


def build_parser() -> argparse.ArgumentParser:
    """train.py's parser: this module's groups, the trainer's, and slime's and Megatron-LM's flags
    (slime.config.surface); a flag of a config record is declared on its field (slime.config.flags)."""
    p = _Parser(prog="train.py", description="slime: RL post-training of LLMs")
    for add in (
        _cluster_flags,
        _data_and_rollout_flags,
        _async_flags,
        _bridge_and_eval_flags,
        _debug_and_logging_flags,
    ):
        add(p)
    add_train_arguments(p)
    add_critic_arguments(p)
    add_opd_arguments(p)
    add_lora_arguments(p)
    add_specs(p, megatron_lm.SPECS, megatron_lm.GROUPS)
    add_specs(p, slime_flags.SPECS, slime_flags.GROUPS)
    return p


def _cluster_flags(p: argparse.ArgumentParser) -> None:
    """Processes and devices, the engines to use, fault tolerance."""
    g = add_flags(p, ClusterConfig, "cluster")["cluster"]  # and the flags that fill no record field:
    g.add_argument(
        "--dry-run",
        action="store_true",
        help="check the flags, the HF config, the inputs and the layout, print the resolved configuration "
        "and the placement plan, and exit (0, or 2 listing every problem); starts nothing, loads no "
        "weights. Without a GPU here it plans for GPUs unless --device cpu is given",
    )
    g.add_argument(
        "--sglang-server-concurrency",
        type=int,
        default=256,
        help="requests in flight per engine (slime's default: 512)",
    )


def _data_and_rollout_flags(p: argparse.ArgumentParser) -> None:
    """The prompts, and how a rollout samples and scores them."""
    add_flags(p, DataConfig, "data")
    add_flags(p, RolloutConfig, "rollout")
    g = add_flags(p, SamplingConfig, "rollout")["rollout"]  # and the flags that fill no record field:
    g.add_argument(
        "--rollout-max-context-len",
        type=int,
        default=None,
        help="slime's context budget: --rollout-max-prompt-len defaults to this - 1; responses stay "
        "within --rollout-max-response-len",
    )
    g.add_argument(
        "--custom-config-path",
        default=None,
        metavar="YAML",
        help="a mapping of settings set on the parsed arguments (overriding the command line), for custom "
        "functions to read from args: KEY: VALUE with the flag's name in underscores",
    )


def _async_flags(p: argparse.ArgumentParser) -> None:
    """Asynchronous rollouts (docs/async.md)."""
    g = add_flags(p, AsyncConfig, "asynchronous rollouts (docs/async.md)")[
        "asynchronous rollouts (docs/async.md)"
    ]
    g.add_argument(
        "--max-policy-version-lag",
        type=int,
        default=None,
        metavar="N",
        help="--fully-async: a group whose oldest trained token is more than N weight versions behind the "
        "trainer is not trained on (see --stale-group-action); admission keeps most groups within it; "
        "0 is the synchronous loop. Default: no bound (the lag is still logged)",
    )
    g.add_argument(
        "--stale-group-action",
        choices=STALE_ACTIONS,
        default=None,
        help="what happens to a group beyond --max-policy-version-lag: requeue its prompt (default; it is "
        "generated again with the current weights) or drop it",
    )
    g.add_argument(
        "--pause-generation-mode",
        choices=PAUSE_MODES,
        default=None,
        help="--fully-async: how a push treats requests in flight (SGLang's modes): retract (default: "
        "they continue with the new weights, their KV cache recomputed), in_place (their KV cache kept), "
        "abort (they end; with --partial-rollout continued as new requests, else generated again; the "
        "default with --partial-rollout)",
    )


def _bridge_and_eval_flags(p: argparse.ArgumentParser) -> None:
    """The weight push, checkpoints, evaluation."""
    add_flags(p, BridgeConfig, "weight bridge")

    add_flags(p, CheckpointConfig, "save and load")

    g = add_flags(p, EvalConfig, "eval")["eval"]  # and the flags of its datasets (slime.config.eval_sets):
    g.add_argument(
        "--eval-prompt-data",
        nargs="+",
        default=None,
        metavar="[NAME] PATH",
        help="one PATH, or NAME PATH pairs: each set's metrics are logged as eval/NAME/...",
    )
    g.add_argument(
        "--eval-config",
        default=None,
        metavar="YAML",
        help="evaluation sets with slime's schema (defaults + datasets, each with name, path, keys, "
        "rm_type and sampling); wins over --eval-prompt-data",
    )
    g.add_argument("--eval-input-key", default=None, help="default: --input-key")
    g.add_argument("--eval-label-key", default=None, help="default: --label-key")
    g.add_argument("--eval-max-prompt-len", type=int, default=None, help="drop longer eval prompts (tokens)")
    g.add_argument("--eval-tool-key", default=None, help="default: --tool-key")
    g.add_argument(
        "--eval-min-new-tokens",
        type=int,
        default=None,
        help="evaluation requests may not stop before this many new tokens (SGLang's min_new_tokens; "
        "SGLang engines only)",
    )
    g.add_argument(
        "--n-samples-per-eval-prompt", type=int, default=1, help="responses sampled per evaluation prompt"
    )
    g.add_argument("--eval-temperature", type=float, default=None, help="default: --rollout-temperature")
    g.add_argument("--eval-top-p", type=float, default=None, help="default: --rollout-top-p")
    g.add_argument("--eval-top-k", type=int, default=None, help="default: --rollout-top-k")
    g.add_argument(
        "--eval-max-response-len", type=int, default=None, help="default: --rollout-max-response-len"
    )
    g.add_argument(
        "--skip-eval-before-train", action="store_true", help="no evaluation before the first rollout"
    )


def _debug_and_logging_flags(p: argparse.ArgumentParser) -> None:
    """docs/debugging.md's modes and checks, and where metrics go."""
    debug = add_flags(p, DebugConfig, "debug: decoupled modes and dumps (docs/debugging.md)")
    g = debug["debug: decoupled modes and dumps (docs/debugging.md)"]
    g.add_argument(
        "--load-debug-rollout-data-subsample",
        type=float,
        default=None,
        metavar="R",
        help="replay a deterministic fraction R of each dump's prompt groups",
    )

    g = debug["debug: precision checks (docs/debugging.md, Precision)"]
    g.add_argument(
        "--precision-logprob-tol",
        type=float,
        default=None,
        help="mean |trainer - engine| log-prob allowed (default by dtype: 1e-4 float32, 5e-2 bfloat16)",
    )
    g.add_argument(
        "--precision-logprob-max-tol",
        type=float,
        default=None,
        help="largest single-token |trainer - engine| log-prob allowed (default 1e-3 float32, 2 bfloat16)",
    )
    g.add_argument(
        "--deterministic-mode",
        action="store_true",
        help="reproducible runs: everything seeded from --seed, torch.use_deterministic_algorithms, "
        "a sampling_seed per sample, batch-invariant engines (slower; docs/debugging.md)",
    )

    g = add_flags(p, LoggingConfig, "logging")["logging"]
    g.add_argument(
        "--wandb-mode",
        choices=["online", "offline", "disabled"],
        default=None,
        help="default: online with a --wandb-key or WANDB_API_KEY, else offline",
    )


def _train_config(ns: argparse.Namespace) -> TrainConfig:
    """The trainer's config; --debug-rollout-only runs no trainer, so its flags are not validated."""
    try:
        return train_config_from_args(ns)
    except ValueError:
        if not ns.debug_rollout_only:
            raise
        return TrainConfig(
            hf_checkpoint=ns.hf_checkpoint,
            device=ns.device,
            seed=ns.seed,
            deterministic=ns.deterministic_mode,
            distributed_timeout_minutes=ns.distributed_timeout_minutes,
        )


def _precision_defaults(ns: argparse.Namespace) -> tuple[str, float, float]:
    """The dtype the log-prob tolerances are for, and the tolerances (flags win)."""
    engine = "float32" if ns.rollout_backend == "torch" else "bfloat16"
    trainer = "bfloat16" if ns.train_backend == "megatron" and ns.bf16 else ns.fsdp_param_dtype
    dtype = lower_precision(engine, trainer)
    mean, worst = TOLERANCES[dtype]
    return (
        dtype,
        ns.precision_logprob_tol if ns.precision_logprob_tol is not None else mean,
        ns.precision_logprob_max_tol if ns.precision_logprob_max_tol is not None else worst,
    )


def cluster_config(ns: argparse.Namespace) -> ClusterConfig:
    """The cluster record of parsed flags (`Config.args` included)."""
    return from_flags(ClusterConfig, ns)


def async_config(ns: argparse.Namespace) -> AsyncConfig:
    """The asynchronous-rollout record of parsed flags."""
    partial = ns.partial_rollout
    # Rollout only: no push ever comes, every token is of the first weights (lag 0).
    lag = None if ns.debug_rollout_only else ns.max_policy_version_lag
    return from_flags(
        AsyncConfig,
        ns,
        max_lag=lag,
        stale_action=ns.stale_group_action or "requeue",
        pause_mode=ns.pause_generation_mode or ("abort" if partial else "retract"),
    )


def sampling_config(ns: argparse.Namespace) -> SamplingConfig:
    """How rollout responses are sampled, from parsed flags (the temperature is the trainer's flag:
    log-probs are computed at it); ValueError names a flag whose value the engines would refuse."""
    sampling = from_flags(SamplingConfig, ns, temperature=ns.rollout_temperature)
    refused = sampling.refused()
    if refused is not None:
        flag = (
            "--rollout-temperature"
            if refused.field == "temperature"
            else flag_name(SamplingConfig, refused.field)
        )
        raise ValueError(f"{flag} {refused.reason}: the engines refuse such a request")
    return sampling


def _configs(ns: argparse.Namespace) -> Config:
    cluster = cluster_config(ns)
    data = None
    if ns.prompt_data is not None:
        data = from_flags(
            DataConfig, ns, messages_as_is=ns.rollout_function_path is not None and not ns.apply_chat_template
        )
    rollout = from_flags(
        RolloutConfig,
        ns,
        data=data,
        sampling=sampling_config(ns),
        rollout_batch_size=ns.rollout_batch_size or 0,
        asynchrony=async_config(ns),
    )
    dtype, tol, max_tol = _precision_defaults(ns)
    wandb_mode = ns.wandb_mode or ("online" if ns.wandb_key or os.environ.get("WANDB_API_KEY") else "offline")
    return Config(
        cluster=cluster,
        rollout=rollout,
        bridge=from_flags(
            BridgeConfig,
            ns,
            # --check-precision adds the fingerprint check where the engines can answer it (torch engine);
            # the adapter push's check (SGLang's expected_checksums) every engine answers, and it is
            # also --check-weight-update-equal's on the adapter (slime.bridge.adapter).
            verify=ns.check_weight_sync
            or (ns.check_precision and ns.rollout_backend == "torch")
            or (
                getattr(ns, "lora_push", None) == "adapter"
                and bool(getattr(ns, "lora_rank", 0))
                and (ns.check_precision or ns.check_weight_update_equal)
            ),
        ),
        checkpoint=from_flags(CheckpointConfig, ns),
        eval=from_flags(
            EvalConfig,
            ns,
            datasets=eval_datasets(ns),
            before_train=not ns.skip_eval_before_train,
            config_path=ns.eval_config,
        ),
        logging=from_flags(LoggingConfig, ns, wandb_mode=wandb_mode),
        train=(train := _train_config(ns)),
        critic=None if ns.debug_rollout_only else critic_config(ns, train),
        opd=opd_config(ns),
        debug=from_flags(
            DebugConfig,
            ns,
            subsample=ns.load_debug_rollout_data_subsample or 1.0,
            precision_dtype=dtype,
            precision_logprob_tol=tol,
            precision_logprob_max_tol=max_tol,
        ),
        args=ns,
    )


class _ParseError(Exception):
    """argparse's own error (an unknown flag, a bad value), raised instead of exiting."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise _ParseError(message)


@dataclass
class Parsed:
    """What `parse` found. `problems`: every problem with the flags, one line each naming the flag
    and the fix (the first is what a normal start reports); `config`: None where the flags cannot
    make one; `parser`: for the usage line of an error; `resolution`: how `auto` resolved."""

    config: Config | None
    problems: list[str]
    ns: argparse.Namespace
    parser: argparse.ArgumentParser
    resolution: Resolution


def parse(argv: list[str] | None = None) -> Parsed:
    """Parse and check the flags, and build the config where they allow it; never exits (but
    for --help). The components' own checks and --dry-run are the job's (slime.ray.cli)."""
    parser = build_parser()
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        mirrored = mirror_sglang_flags(parser, args)  # parses the flags once itself
        if "--dry-run" in args:  # every problem is listed, unknown flags with the rest
            ns, unknown = parser.parse_known_args(args)
        else:
            ns, unknown = parser.parse_args(args), []
    except _ParseError as e:
        return Parsed(None, [str(e)], argparse.Namespace(dry_run="--dry-run" in args), parser, Resolution())
    custom = custom_config(ns, {a.dest: a.type for a in parser._actions if a.type is not None})
    resolution = resolve(ns)
    found = (
        custom + [f"unrecognized argument: {u}" for u in unknown] + flag_problems(ns, mirrored, resolution)
    )
    config = None
    if not found or ns.dry_run:  # a dry run goes on to the inputs when the configs can be built
        try:
            config = _configs(ns)
        except ValueError as e:
            found.append(str(e))
        except TypeError as e:  # a --custom-config-path value of the wrong type
            found.append(f"a setting has the wrong type ({e}); check --custom-config-path's values")
        except Exception:  # settings already found wrong cannot always make a config: they are listed
            if not found:
                raise
    if config is not None:  # the rules between settings read the records
        found += [*config_problems(config), *model_problems(config)]
    note = getattr(ns, "sequence_parallel_note", None)
    if note:
        resolution.lines.append(note)
    if config is not None:
        config.args.resolution = resolution.lines + no_effect_lines(ns)
    return Parsed(
        config, list(dict.fromkeys(found)), ns, parser, resolution
    )  # a rule met twice is one problem


def describe(config: Config) -> dict[str, Any]:
    """Facts for the start-up banner."""
    c = config.cluster
    unit = "GPU" if c.device == "cuda" else "CPU process"
    return {
        "train": f"{c.num_train_ranks} × {c.train_backend} rank ({unit} each)",
        "rollout": f"{c.num_engines} × external engine ({', '.join(c.external_engine_addrs)})"
        if c.external_engine_addrs
        else f"{c.num_engines} × {c.rollout_backend} engine ({c.rollout_num_gpus_per_engine} {unit} each)",
        "layout": "colocated" if c.colocate else "disaggregated",
    }
