"""The rules between train.py's flags: each check returns the first problem as one message
naming the flag and the fix (parse_args turns it into exit code 2), or None."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Iterator

from slime.config.debug import check_debug, check_debug_checks
from slime.config.rollout import needs_reward_key
from slime.utils.tracking import check_available


def positive(ns: argparse.Namespace, *names: str) -> str | None:
    for name in names:
        value = getattr(ns, name)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')} must be >= 1 (got {value})"
    return None


def rule_problems(ns: argparse.Namespace, sizes_only: bool = False) -> Iterator[str]:
    """The problems with the flags, one message each. A problem with the sizes ends the list (the
    rules after it divide by them); `sizes_only`: only those."""
    problem = positive(
        ns,
        "actor_num_nodes",
        "actor_num_gpus_per_node",
        "rollout_num_gpus",
        "rollout_num_gpus_per_engine",
        "n_samples_per_prompt",
        "rollout_batch_size",
        "num_rollout",
        "num_epoch",
        "save_interval",
        "eval_interval",
        "update_weight_buffer_size",
        "rollout_max_response_len",
        "over_sampling_batch_size",
        "n_samples_per_eval_prompt",
        "eval_max_response_len",
    )
    if problem or sizes_only:
        yield from [problem] if problem else []
        return
    if ns.rollout_function_path is not None and ns.custom_generate_function_path is not None:
        yield (
            "--rollout-function-path replaces the whole rollout, so --custom-generate-function-path "
            "would never run: give one of them"
        )
    for group in (
        check_debug,
        check_debug_checks,
        check_fault_tolerance,
        check_external,
        check_loss_mask_type,
        check_async,
        check_global_dataset,
        check_delta,
    ):
        problem = group(ns)
        if problem:
            yield problem
    yield from _required(ns)
    yield from _layout(ns)
    yield from _rewards_and_schedule(ns)


def _required(ns: argparse.Namespace) -> Iterator[str]:
    """What a run cannot do without: the rollout size, the prompts, how long to train."""
    replay = ns.load_debug_rollout_data is not None
    if ns.rollout_batch_size is None and not replay:
        yield "--rollout-batch-size is required (prompts per rollout)"
    if ns.prompt_data is None and ns.rollout_function_path is None and not replay:
        yield "--prompt-data is required (or a --rollout-function-path that brings its own data)"
    if ns.num_rollout is None and ns.num_epoch is None:
        yield "give --num-rollout or --num-epoch (how long to train)"
    elif ns.num_rollout is None and ns.prompt_data is None:
        yield "--num-epoch counts passes over --prompt-data; without it give --num-rollout"


def _layout(ns: argparse.Namespace) -> Iterator[str]:
    """The processes, the engines, the weight push and the router."""
    if ns.rollout_num_gpus % ns.rollout_num_gpus_per_engine:
        yield (
            f"--rollout-num-gpus {ns.rollout_num_gpus} is not a multiple of --rollout-num-gpus-per-engine "
            f"{ns.rollout_num_gpus_per_engine}"
        )
    from slime.config.rollout import transport_problem

    problem = transport_problem(ns.update_weight_transport, ns.device, ns.colocate)
    if problem is not None:
        yield problem
    if (ns.sglang_router_ip is None) != (ns.sglang_router_port is None):
        yield "--sglang-router-ip and --sglang-router-port go together: give both, or neither"
    if ns.rollout_backend == "torch" and ns.rollout_num_gpus_per_engine != 1:
        yield "--rollout-backend torch runs tensor-parallel size 1: use --rollout-num-gpus-per-engine 1"
    if ns.rollout_backend == "torch" and ns.eval_min_new_tokens:
        yield (
            "--eval-min-new-tokens is SGLang's min_new_tokens, which the torch engine does not "
            "apply: use --rollout-backend sglang"
        )
    train_ranks = ns.actor_num_nodes * ns.actor_num_gpus_per_node
    if ns.debug_disable_sharding and train_ranks != 1 and not ns.debug_rollout_only:
        yield (
            f"--debug-disable-sharding runs one unsharded train rank, but --actor-num-nodes × "
            f"--actor-num-gpus-per-node is {train_ranks}: set both to 1"
        )
    if ns.colocate and ns.rollout_num_gpus != train_ranks:
        yield (
            f"--colocate puts engines on the trainer's {train_ranks} devices, but --rollout-num-gpus is "
            f"{ns.rollout_num_gpus}; drop --rollout-num-gpus or make them equal"
        )
    if ns.over_sampling_batch_size is not None and ns.over_sampling_batch_size < (ns.rollout_batch_size or 0):
        yield "--over-sampling-batch-size must be >= --rollout-batch-size"


def _rewards_and_schedule(ns: argparse.Namespace) -> Iterator[str]:
    """The reward, saving and evaluating, the batch arithmetic, the Megatron flags, the loggers
    and the files named."""
    replay = ns.load_debug_rollout_data is not None
    scored_by_plugin = ns.rollout_function_path or ns.custom_generate_function_path  # may set rewards itself
    if ns.rm_type is None and ns.custom_rm_path is None and not scored_by_plugin and not replay:
        yield (
            "choose a reward: --rm-type TYPE (math, deepscaler, dapo, ...) or --custom-rm-path "
            "package.module.function"
        )
    if needs_reward_key(ns.rm_type) and not ns.custom_rm_path and ns.reward_key is None:
        yield (
            f"--rm-type {ns.rm_type} returns a dict {{score, acc, pred}}: add --reward-key score (as "
            "slime's scripts do)"
        )
    if ns.save_interval is not None and ns.save is None:
        yield "--save-interval needs --save DIR"
    if ns.eval_interval is not None and ns.eval_prompt_data is None and ns.eval_config is None:
        yield "--eval-interval needs --eval-prompt-data (or --eval-config)"
    rollout_samples = (ns.rollout_batch_size or 0) * ns.n_samples_per_prompt
    if ns.debug_rollout_only or replay:
        pass  # no trainer, or the dumps decide the rollout size: checked when training starts
    elif ns.global_batch_size is not None and rollout_samples % ns.global_batch_size:
        yield (
            f"--rollout-batch-size × --n-samples-per-prompt = {rollout_samples} samples per rollout, "
            f"not a multiple of --global-batch-size {ns.global_batch_size}"
        )
    elif ns.num_steps_per_rollout is not None and rollout_samples % ns.num_steps_per_rollout:
        yield (
            f"{rollout_samples} samples per rollout cannot be split into --num-steps-per-rollout "
            f"{ns.num_steps_per_rollout}"
        )
    if ns.train_backend == "megatron" or not _megatron_defaults(ns):
        problem = check_megatron(ns)
        if problem:
            yield problem
    missing = check_available(ns.use_wandb, ns.use_tensorboard)
    if missing:
        yield missing
    if ns.prompt_data is not None and not os.path.isfile(ns.prompt_data):
        yield f"--prompt-data {ns.prompt_data!r}: no such file"
    from slime.config.eval_sets import name_path_pairs

    for _, path in name_path_pairs(ns.eval_prompt_data or []):
        if not os.path.isfile(path):
            yield f"--eval-prompt-data {path!r}: no such file"


def check_async(ns: argparse.Namespace) -> str | None:
    """The asynchronous-rollout flags (docs/async.md)."""
    lag = ns.max_policy_version_lag
    if not ns.fully_async:
        for given, flag in (
            (lag is not None, "--max-policy-version-lag"),
            (ns.stale_group_action, "--stale-group-action"),
            (ns.pause_generation_mode, "--pause-generation-mode"),
        ):
            if given:
                return (
                    f"{flag} applies to the continuous schedule only (train.py is synchronous, "
                    f"train_async.py one step off: their lag is 0 and 1): add --fully-async or drop {flag}"
                )
    if lag is not None and lag < 0:
        return f"--max-policy-version-lag must be >= 0 (got {lag})"
    if ns.stale_group_action and lag is None:
        return "--stale-group-action says what happens beyond --max-policy-version-lag: give the bound too"
    if ns.partial_rollout and getattr(ns, "deterministic_mode", False):
        return (
            "--partial-rollout continues requests from wherever a push or the over-sampling cut them off, "
            "which depends on timing, so two runs would differ: drop --partial-rollout or "
            "--deterministic-mode"
        )
    if ns.mask_offpolicy_in_partial_rollout and not ns.partial_rollout:
        return (
            "--mask-offpolicy-in-partial-rollout masks the tokens of continued requests: add "
            "--partial-rollout"
        )
    if ns.fully_async and ns.colocate:
        return (
            "--fully-async generates while the trainer trains, so the engines need GPUs of their own: drop "
            "--colocate (or use train_async.py without --fully-async, or train.py)"
        )
    if ns.fully_async and ns.rollout_function_path is not None:
        return (
            "--fully-async runs the built-in rollout continuously; --rollout-function-path replaces it: "
            "give one of them (a per-sample --custom-generate-function-path works with --fully-async)"
        )
    return check_update_interval(ns)


def check_global_dataset(ns: argparse.Namespace) -> str | None:
    """--disable-rollout-global-dataset: only a rollout function that brings its own data runs without one."""
    if ns.rollout_global_dataset:
        return None
    if ns.rollout_function_path is None:
        return (
            "--disable-rollout-global-dataset leaves the built-in rollout without prompts: give a "
            "--rollout-function-path that brings its own data, or drop the flag"
        )
    if ns.num_rollout is None:
        return (
            "--disable-rollout-global-dataset: --num-epoch counts passes over the dataset; give --num-rollout"
        )
    return None


def check_delta(ns: argparse.Namespace) -> str | None:
    """--update-weight-mode delta and the disk transport's directories."""
    if ns.update_weight_mode != "delta":
        if ns.update_weight_local_checkpoint_dir:
            return (
                "--update-weight-local-checkpoint-dir is the engine hosts' checkpoint of "
                "--update-weight-mode delta; full disk pushes are read from --update-weight-disk-dir "
                "directly: drop it, or add --update-weight-mode delta"
            )
        return None
    if ns.update_weight_transport != "disk":
        return (
            "--update-weight-mode delta publishes to disk: use --update-weight-transport disk, not "
            f"{ns.update_weight_transport}"
        )
    if ns.colocate:
        return (
            "--update-weight-mode delta: colocated engines take the weights in place through CUDA IPC, "
            "where a delta saves nothing: drop --update-weight-mode delta or --colocate"
        )
    missing = [
        f
        for f, v in (
            ("--update-weight-disk-dir", ns.update_weight_disk_dir),
            ("--update-weight-local-checkpoint-dir", ns.update_weight_local_checkpoint_dir),
        )
        if not v
    ]
    if missing:
        return (
            f"--update-weight-mode delta needs {' and '.join(missing)}: where versions are published (a "
            "directory every engine host reads) and each host's own checkpoint (local disk)"
        )
    if ns.lora_rank:
        return (
            "--update-weight-mode delta pushes full weights' changes; with --lora-rank push the "
            "adapters or merged weights"
        )
    return delta_dirs_problem(
        ns.hf_checkpoint, ns.update_weight_disk_dir, ns.update_weight_local_checkpoint_dir
    )


def delta_dirs_problem(hf_checkpoint: str | None, disk_dir: str, local_dir: str) -> str | None:
    """The delta stream's directories apart: each host's checkpoint is patched in place, and a new
    stream removes its versions from the disk directory."""
    from slime.utils.weight_delta import within

    if within(local_dir, hf_checkpoint) or within(local_dir, disk_dir) or within(disk_dir, local_dir):
        return (
            "--update-weight-local-checkpoint-dir is patched in place by every push: it must be apart from "
            "--hf-checkpoint and --update-weight-disk-dir (neither inside the other)"
        )
    if within(hf_checkpoint, disk_dir):
        return (
            "--update-weight-disk-dir must not hold --hf-checkpoint: a delta stream removes the "
            "versions it wrote there"
        )
    return None


def check_update_interval(ns: argparse.Namespace) -> str | None:
    """--update-weights-interval against the layouts where engines must get every version (and
    --balance-by-flops, which cuts dynamic micro-batches)."""
    if ns.keep_old_actor and (ns.fully_async or ns.partial_rollout):
        return (
            "--keep-old-actor takes each rollout's old log-probs with the one weight version that "
            f"generated it; {'--fully-async' if ns.fully_async else '--partial-rollout'} mixes versions "
            "within a rollout: drop one of them"
        )
    if ns.balance_by_flops and not ns.use_dynamic_batch_size:
        return (
            "--balance-by-flops balances dynamic micro-batches: add --use-dynamic-batch-size (and "
            "--max-tokens-per-gpu)"
        )
    n = ns.update_weights_interval
    if n < 1:
        return f"--update-weights-interval must be >= 1 (got {n})"
    if n > 1 and ns.colocate:
        return (
            "--update-weights-interval: colocated engines give their weights' memory up while the trainer "
            "trains and take it back with each push, so every rollout must push: drop "
            "--update-weights-interval or --colocate"
        )
    if n > 1 and ns.fully_async:
        return (
            "--update-weights-interval: --fully-async bounds staleness with --max-policy-version-lag and "
            "pushes after every step; drop --update-weights-interval"
        )
    if ns.start_rollout_id is not None and ns.start_rollout_id < 0:
        return f"--start-rollout-id must be >= 0 (got {ns.start_rollout_id})"
    return None


def check_loss_mask_type(ns: argparse.Namespace) -> str | None:
    from slime.utils.mask_utils import SUPPORTED

    if ns.loss_mask_type not in SUPPORTED:
        return (
            f"--loss-mask-type {ns.loss_mask_type} is not supported here: its chat templates rewrite "
            f"earlier turns, which the mask generator does not follow; use one of {', '.join(SUPPORTED)}"
        )
    return None


def check_external(ns: argparse.Namespace) -> str | None:
    """--rollout-external-engine-addrs: HOST:PORT each; not with what needs launched engines."""
    addrs = ns.rollout_external_engine_addrs
    if addrs is None:
        return None
    normalized = []
    for addr in addrs:
        hostport = addr.removeprefix("http://").rstrip("/")
        host, _, port = hostport.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            return f"--rollout-external-engine-addrs {addr!r}: expected HOST:PORT (e.g. 10.0.0.5:30000)"
        normalized.append(f"http://{hostport}")
    if len(set(normalized)) != len(normalized):
        return "--rollout-external-engine-addrs names an engine twice"
    if ns.colocate:
        return (
            "--colocate places launched engines beside the trainer; external engines run "
            "elsewhere: drop --colocate"
        )
    if ns.debug_train_only:
        return (
            "--rollout-external-engine-addrs with --debug-train-only: the mode uses no engine; "
            "give one of them"
        )
    ns.rollout_external_engine_addrs = normalized
    return None


def check_fault_tolerance(ns: argparse.Namespace) -> str | None:
    """--use-fault-tolerance and its engine health checks."""
    for flag in ("rollout_health_check_interval", "rollout_health_check_timeout"):
        value = getattr(ns, flag)
        if value is not None and not value > 0:
            return f"--{flag.replace('_', '-')} must be > 0, got {value}"
    if ns.rollout_health_check_first_wait is not None and ns.rollout_health_check_first_wait < 0:
        return f"--rollout-health-check-first-wait must be >= 0, got {ns.rollout_health_check_first_wait}"
    if ns.use_fault_tolerance and ns.colocate and ns.device != "cpu":
        return (
            "--use-fault-tolerance with --colocate on GPUs is not built yet: a restarted engine would "
            "take its GPU memory while the trainer holds it, and the CUDA-IPC push reaches every engine "
            "or none; drop one of them"
        )
    given = [
        f
        for f in ("interval", "timeout", "first_wait")
        if getattr(ns, f"rollout_health_check_{f}") is not None
    ]
    if given and not ns.use_fault_tolerance:
        flag = "--rollout-health-check-" + given[0].replace("_", "-")
        return (
            f"{flag} sets the engine health checks, which run only with --use-fault-tolerance: add "
            f"it (or drop {flag})"
        )
    return None


def megatron_flags() -> dict[str, object]:
    """Each Megatron flag's dest and default (MegatronConfig's fields). --expert-tensor-parallel-size
    and --decoder-first/last-pipeline-num-layers are not among them: slime's scripts pass them with
    FSDP too, where they have no effect (their Specs)."""
    from slime.config.train import MegatronConfig

    fsdp_too = (
        "expert_tensor_parallel_size",
        "decoder_first_pipeline_num_layers",
        "decoder_last_pipeline_num_layers",
        # refused by name with FSDP (their Specs); --mtp-loss-scaling-factor's default is slime's
        "mtp_num_layers",
        "mtp_loss_scaling_factor",
        "enable_mtp_training",
    )
    return {f.name: f.default for f in dataclasses.fields(MegatronConfig) if f.name not in fsdp_too}


def _megatron_defaults(ns: argparse.Namespace) -> bool:
    return all(getattr(ns, k) == v for k, v in megatron_flags().items())


def check_megatron(ns: argparse.Namespace) -> str | None:
    """The Megatron layout against the train ranks; what the Megatron actor builds and the model
    allows (heads, layers, experts) is its own check (slime.backends.megatron.settings.
    layout_problem), in the job's validation pass."""
    flags = megatron_flags()
    given = [f"--{k.replace('_', '-')}" for k, v in flags.items() if getattr(ns, k) != v]
    if ns.train_backend != "megatron":
        return (
            f"{', '.join(given)} configure --train-backend megatron; with --train-backend "
            f"{ns.train_backend} drop them"
        )
    from slime.config.flags import from_flags
    from slime.config.train import MegatronConfig

    try:
        megatron = from_flags(MegatronConfig, ns)
    except ValueError as e:
        return str(e)
    ranks = ns.actor_num_nodes * ns.actor_num_gpus_per_node
    tp, pp, cp = ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size, ns.context_parallel_size
    uneven = [end for end, v in zip(("first", "last"), megatron.stage_layers, strict=True) if v is not None]
    if uneven and pp < 2:
        return (
            f"--decoder-{uneven[0]}-pipeline-num-layers sets a pipeline stage's layers: give "
            "--pipeline-model-parallel-size > 1"
        )
    if ranks % (tp * pp * cp):
        return (
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} x "
            f"--context-parallel-size {cp} = {tp * pp * cp} does not divide the {ranks} train ranks "
            "(--actor-num-nodes x --actor-num-gpus-per-node)"
        )
    ep, etp = megatron.expert_model_parallel_size, megatron.etp
    if ranks % (ep * etp * pp):
        return (
            f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} x "
            f"--pipeline-model-parallel-size {pp} = {ep * etp * pp} does not divide the {ranks} train "
            "ranks (megatron-core's expert layout)"
        )
    fsdp_only = [
        f"--{d.replace('_', '-')}"
        for d in ("debug_disable_sharding", "fsdp_cpu_offload")
        if getattr(ns, d, False)
    ]
    fsdp_only += [
        f"--{d.replace('_', '-')}"
        for d in ("fsdp_param_dtype", "fsdp_reduce_dtype")
        if getattr(ns, d, "float32") != "float32"
    ]
    if fsdp_only:
        return f"{', '.join(fsdp_only)} configure the FSDP backend; with --train-backend megatron drop them"
    return None
