"""What `parse` (slime.config.arguments) does between argparse and the configs: the settings
whose default depends on other flags, slime's spellings of ours, --custom-config-path, and the
architecture flags against the HF config. Each function fills `ns` in place and returns the
problems it found."""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

from slime.config import architecture, megatron_lm, slime_flags
from slime.config.command_line import command_line_problems, size_problem
from slime.config.resolve import Resolution, package_problems
from slime.config.sglang_args import reserved_problem, server_argv, torch_engine_problem
from slime.config.surface import no_effect_given, refused_problems
from slime.utils.model_families import family, refusal, routes_in_fp32

logger = logging.getLogger(__name__)

SPECS = megatron_lm.SPECS + slime_flags.SPECS
FULLY_ASYNC_PATH = "slime.rollout.fully_async_rollout.generate_rollout_fully_async"


def custom_config(ns: argparse.Namespace, types: dict[str, Any]) -> list[str]:
    """--custom-config-path: every key of the YAML mapping set on `ns` (slime's rule: the file wins
    over the command line); keys that are no flag's are kept for custom functions."""
    path = ns.custom_config_path
    if path is None:
        return []
    import yaml

    try:
        with open(path) as f:
            values = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        return [f"--custom-config-path {path}: cannot be read ({e})"]
    if not isinstance(values, dict) or not all(isinstance(k, str) for k in values):
        return [f"--custom-config-path {path}: the top level must be a mapping of names to values"]
    for key, value in values.items():
        kind = types.get(key)
        if kind is not None and isinstance(value, str):  # YAML reads 1e-5 as a string
            try:
                value = kind(value)
            except (TypeError, ValueError):
                return [
                    f"--custom-config-path {path}: {key}: {value!r} is not a valid "
                    f"{getattr(kind, '__name__', kind)}"
                ]
        if getattr(ns, key, value) != value:
            logger.info("--custom-config-path %s sets %s = %r (was %r)", path, key, value, getattr(ns, key))
        setattr(ns, key, value)
    return []


def fill_defaults(ns: argparse.Namespace) -> list[str]:
    """Flags whose default depends on others, and slime's spellings of ours."""
    out = []
    if ns.rollout_function_path == "slime.rollout.sglang_rollout.generate_rollout":
        ns.rollout_function_path = None  # slime's default, named: the built-in rollout (the same function)
    if ns.rollout_function_path == FULLY_ASYNC_PATH:
        ns.rollout_function_path = None  # slime's fully asynchronous rollout: our continuous schedule
        ns.fully_async = True
    external = ns.rollout_external_engine_addrs
    if external is not None and ns.rollout_num_gpus is not None:
        out.append(
            "--rollout-num-gpus sizes the engines slime launches; with --rollout-external-engine-addrs "
            "none is launched: drop --rollout-num-gpus"
        )
    if ns.rollout_num_gpus is None:
        ns.rollout_num_gpus = (
            len(external)
            if external
            else ns.actor_num_nodes * ns.actor_num_gpus_per_node
            if ns.colocate
            else 1
        )
    if ns.update_weight_transport in (None, "nccl"):  # slime's nccl: its default, whatever the layout
        from slime.config.rollout import default_transport

        ns.update_weight_transport = default_transport(ns.device, ns.colocate)
    for name in (
        "update_weight_disk_dir",
        "update_weight_local_checkpoint_dir",
    ):  # one path for every process
        if getattr(ns, name):
            setattr(ns, name, os.path.abspath(getattr(ns, name)))
    if ns.release_train:  # slime restarts the trainer's processes; here it gives its memory up
        ns.offload_train = True
    if ns.load_debug_rollout_data is not None:
        ns.debug_train_only = True  # a replay starts no engine
    if ns.debug_sync_parameters_path is None:
        ns.debug_sync_parameters_path = os.environ.get("DEBUG_SYNC_PARAMETERS_PATH") or None
    if ns.eval_max_context_len is None:
        ns.eval_max_context_len = ns.rollout_max_context_len
    out += dump_details(ns)
    if ns.no_offload_train and (ns.offload or ns.offload_train):
        asked = "--offload" if ns.offload else "--offload-train"
        out.append(f"{asked} and --no-offload-train contradict each other: give one")
    # slime's defaults: colocated, the trainer and the engines each give their memory up while the
    # other works; --offload is both; --no-offload-train / --no-offload-rollout keep it (a memory
    # choice: results agree).
    if ns.no_offload_rollout and ns.offload_rollout:
        out.append("--offload-rollout and --no-offload-rollout contradict each other: give one")
    ns.offload_rollout = (ns.colocate or ns.offload_rollout or ns.offload) and not ns.no_offload_rollout
    ns.offload = (ns.offload or ns.offload_train or ns.colocate) and not ns.no_offload_train
    if ns.sequence_parallel and ns.tensor_model_parallel_size == 1:
        # Megatron-LM turns it off at TP 1 too: there is nothing to split, so nothing changes.
        ns.sequence_parallel = False
        ns.sequence_parallel_note = (
            "--sequence-parallel: off with --tensor-model-parallel-size 1 (as in Megatron-LM)"
        )
    out += schedule_defaults(ns)
    if ns.recompute_granularity == "full" and ns.train_backend == "fsdp":
        ns.gradient_checkpointing = True  # every decoder layer, as FSDP's checkpointing does
    if ns.accumulate_allreduce_grads_in_fp32 and ns.fsdp_reduce_dtype != "float32":
        out.append(
            "--accumulate-allreduce-grads-in-fp32 asks for float32 gradient reductions, and "
            f"--fsdp-reduce-dtype is {ns.fsdp_reduce_dtype}: drop one of them"
        )
    ctx = ns.rollout_max_context_len
    if ctx is not None:
        if ctx < 2:
            out.append(f"--rollout-max-context-len must be >= 2, got {ctx}")
        elif ns.rollout_max_prompt_len is None:
            ns.rollout_max_prompt_len = ctx - 1  # slime's rule: the prompt leaves room for one token
        elif ns.rollout_max_prompt_len > ctx - 1:
            out.append(
                f"--rollout-max-prompt-len {ns.rollout_max_prompt_len} leaves no room for a response within "
                f"--rollout-max-context-len {ctx}: make it at most {ctx - 1}"
            )
    return out


def dump_details(ns: argparse.Namespace) -> list[str]:
    """--dump-details DIR: slime's layout of every dump under DIR (rollout_data/{rollout_id}.pt,
    rollout_data/eval_{rollout_id}.pt, train_data/{rollout_id}_{rank}.pt; the tokenizer in DIR/tokenizer)."""
    root = ns.dump_details
    if root is None:
        return []
    given = [
        f
        for f in ("save_debug_rollout_data", "save_debug_eval_data", "save_debug_train_data")
        if getattr(ns, f)
    ]
    if given:
        return [
            f"--dump-details names every dump's path; drop --{given[0].replace('_', '-')} (or --dump-details)"
        ]
    ns.save_debug_rollout_data = os.path.join(root, "rollout_data", "{rollout_id}.pt")
    ns.save_debug_eval_data = os.path.join(root, "rollout_data", "eval_{rollout_id}.pt")
    ns.save_debug_train_data = os.path.join(root, "train_data", "{rollout_id}_{rank}.pt")
    return []


def train_iters(ns: argparse.Namespace) -> int | None:
    """The run's optimizer steps (Megatron-LM's train_iters, as slime computes it), when the flags
    fix it: --num-rollout x the steps per rollout."""
    if ns.rollout_batch_size is None:
        return None
    rollouts = ns.num_rollout
    if rollouts is None and ns.num_epoch is not None and ns.prompt_data and os.path.isfile(ns.prompt_data):
        # slime's count: epochs x the prompts' rollouts (the driver counts after the length filter)
        from slime.utils.data_files import DataError, read_rows

        try:
            rollouts = max(
                1, ns.num_epoch * len(read_rows(ns.prompt_data, "--prompt-data")) // ns.rollout_batch_size
            )
        except DataError:
            return None  # reported by the input checks
    if rollouts is None:
        return None
    samples = ns.rollout_batch_size * ns.n_samples_per_prompt
    if ns.num_steps_per_rollout:
        return rollouts * ns.num_steps_per_rollout
    return rollouts * max(1, samples // (ns.global_batch_size or samples))


def schedule_defaults(ns: argparse.Namespace) -> list[str]:
    """Megatron-LM's rules: --lr-decay-iters defaults to the run's optimizer steps, and
    --lr-warmup-fraction is that fraction of the decay steps."""
    fraction = ns.lr_warmup_fraction
    decay = ns.lr_decay_iters or None
    if decay is None and (ns.lr_decay_style != "constant" or fraction is not None):
        decay = train_iters(ns)  # counted only when needed: with --num-epoch it reads the prompt file
        if ns.lr_decay_iters is None and ns.lr_decay_style != "constant":
            ns.lr_decay_iters = decay
    if fraction is None:
        return []
    if ns.lr_warmup_iters:
        return ["--lr-warmup-fraction and --lr-warmup-iters both set the warm-up: give one"]
    if not 0.0 <= fraction <= 1.0:
        return [f"--lr-warmup-fraction must be in [0, 1], got {fraction}"]
    if decay is None:
        return [
            "--lr-warmup-fraction is a fraction of --lr-decay-iters (default: the run's optimizer steps, "
            "from --num-rollout or --num-epoch): give one of them"
        ]
    ns.lr_warmup_iters = round(fraction * decay)
    return []


def checkpoint_architecture_problems(ns: argparse.Namespace) -> list[str]:
    """The architecture flags (and slime's layer spec) against --hf-checkpoint's config.json
    (when it can be read here; a missing checkpoint is reported by the input checks)."""
    spec = getattr(ns, "spec", None)
    if not architecture.megatron_architecture(ns) and not spec:
        return []  # no architecture flag given: nothing to compare, nothing to read
    config = architecture.hf_config(ns.hf_checkpoint)
    if config is None:
        return []
    where = f"--hf-checkpoint {ns.hf_checkpoint}"
    return architecture.spec_problems(spec, config, where) + architecture.architecture_problems(
        ns, config, where
    )


def no_effect_lines(ns: argparse.Namespace) -> list[str]:
    flags = no_effect_given(ns, SPECS, ns.train_backend)
    return [f"no effect in this backend ({ns.train_backend}): {', '.join(flags)}"] if flags else []


def flag_problems(
    ns: argparse.Namespace, mirrored: dict[str, tuple[str, str]], resolution: Resolution
) -> list[str]:
    """Every problem with the command line (and, where it can be read, the HF config), in order;
    the first is what a normal start reports. Defaults that depend on other flags are filled in.
    The rules between settings run on the records built after (slime.config.checks)."""
    out = refused_problems(ns, SPECS, ns.train_backend)
    sizes = size_problem(ns)
    if sizes:  # the rules below divide by them
        return [*out, sizes]
    reserved = reserved_problem(ns, mirrored)
    if reserved:
        out.append(reserved)
    ns.sglang_server_args = server_argv(ns, mirrored)
    if ns.rollout_backend == "torch":  # the options the torch engine shares with SGLang reach it
        problem = torch_engine_problem(ns.sglang_server_args)
        if problem:
            out.append(problem)
    out += fill_defaults(ns)
    packages = package_problems(ns)
    if resolution.planning_elsewhere:
        resolution.lines += [f"not installed here (the GPU machine needs it): {p}" for p in packages]
    else:
        out += packages
    out += command_line_problems(ns)
    out += checkpoint_architecture_problems(ns)
    out += moe_flag_problems(ns)
    return out


def moe_flag_problems(ns: argparse.Namespace) -> list[str]:
    """A flag only a mixture-of-experts model honours (MoEOptions.needs_moe), given with a dense
    --hf-checkpoint, is refused here by name with either backend.

    --use-rollout-routing-replay: SGLang engines are asked to report routed experts, and the
    rollout learns the shape of what they report ([tokens - 1, layers, top-k]) as slime's
    rollout does, from args.num_layers and args.moe_router_topk (filled from config.json when
    the script gives no model flags)."""
    from slime.config.flags import from_flags
    from slime.config.train import MoEOptions

    try:
        options = from_flags(MoEOptions, ns)
    except ValueError:  # a bad MoE flag: train_config_from_args names it
        return []
    flag = options.needs_moe
    if flag is None:
        return []
    r3 = bool(getattr(ns, "use_rollout_routing_replay", False))
    if r3 and ns.rollout_backend != "torch" and "--enable-return-routed-experts" not in ns.sglang_server_args:
        ns.sglang_server_args = [*ns.sglang_server_args, "--enable-return-routed-experts"]
    path = ns.hf_checkpoint
    config = architecture.hf_config(path)
    if config is None:
        return []
    text = config.get_text_config()  # a vision-language model's experts are its language model's
    experts = getattr(text, "num_experts", None) or getattr(text, "n_routed_experts", None)
    why = refusal(config.model_type, "router_hooks") if experts else None
    if experts and family(config.model_type) is None and not getattr(text, "num_experts", None):
        # a family not listed, routed otherwise than the Qwen MoE families' routers
        why = (
            f"routing replay and the router's aux loss are not built for model_type {config.model_type!r} yet"
        )
    if why:
        hooked = options.needs_router_hooks(
            router_fp32=routes_in_fp32(config.model_type, ns.fsdp_param_dtype)
        )
        return [f"{hooked}: {why}"] if hooked else []
    if not experts or not getattr(text, "num_experts_per_tok", None):
        return [
            f"{flag} needs a mixture-of-experts model; --hf-checkpoint {path} ({config.model_type}) has "
            "no routed experts"
        ]
    if not r3:
        return []
    if ns.num_layers is None:
        ns.num_layers = text.num_hidden_layers
    if ns.moe_router_topk is None:
        ns.moe_router_topk = text.num_experts_per_tok
    return []
