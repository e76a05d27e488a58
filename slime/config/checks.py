"""The rules between settings, read on the typed records once they are built: each yields one
message naming the flag and the fix (parse_args turns the first into exit code 2). What a flag
says on its own, and a flag given without the one it needs, is checked on the command line before
(slime.config.command_line)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

from slime.config.backends import FSDP_ONLY, FSDPConfig
from slime.config.debug import DebugConfig
from slime.config.flags import flags_of
from slime.config.records import Config
from slime.config.rollout import needs_reward_key
from slime.utils.tracking import check_available


def config_problems(config: Config) -> Iterator[str]:
    """Every rule's problem, in order."""
    r = config.rollout
    if r.rollout_function_path is not None and r.custom_generate_function_path is not None:
        yield (
            "--rollout-function-path replaces the whole rollout, so --custom-generate-function-path "
            "would never run: give one of them"
        )
    for group in (
        debug_modes,
        debug_checks,
        _fault_tolerance,
        _external,
        _async,
        _global_dataset,
        _delta,
        _required,
        _layout,
        _rewards,
        _schedule,
    ):
        yield from group(config)


def debug_modes(c: Config) -> Iterator[str]:
    """The debug modes (--load-debug-rollout-data has turned --debug-train-only on)."""
    d, rollout_function = c.debug, c.rollout.rollout_function_path
    if d.rollout_only and d.train_only:
        yield (
            "--debug-rollout-only and --debug-train-only (or --load-debug-rollout-data) exclude each "
            "other: the first runs no trainer, the second no engine"
        )
        return
    if not d.train_only:
        return
    if d.load_rollout_data is None and rollout_function is None:
        yield (
            "--debug-train-only starts no engine: give --load-debug-rollout-data TEMPLATE, or a "
            "--rollout-function-path that needs no engine"
        )
    elif d.load_rollout_data is not None and c.rollout.num_rollout is None:
        yield "--load-debug-rollout-data replays rollout ids 0 .. --num-rollout - 1: give --num-rollout"
    elif c.eval.interval is not None and rollout_function is None:
        yield (
            "--eval-interval generates with an engine, and --debug-train-only starts none: drop "
            "--eval-interval (or evaluate with a --rollout-function-path that needs no engine)"
        )
    elif d.save_rollout_data is not None and d.load_rollout_data is not None:
        yield "--save-debug-rollout-data with --load-debug-rollout-data would copy the dumps: give one"


def _no_push(d: DebugConfig) -> bool:
    return d.rollout_only or d.train_only


def debug_checks(c: Config) -> Iterator[str]:
    """The precision and weight-sync checks against the modes and engines that can answer them."""
    d = c.debug
    if d.check_precision and c.train.loss.use_rollout_logprobs:
        yield (
            "--check-precision gates the first step on ppo_kl == 0, and --use-rollout-logprobs measures "
            "the ratio against the engine's log-probs (ppo_kl is the trainer-engine gap): give one of "
            "them"
        )
    elif d.check_precision and d.rollout_only:
        yield (
            "--check-precision checks the trainer against the engines, and --debug-rollout-only "
            "starts no trainer"
        )
    checks = {
        "--debug-sync-parameters-path": d.sync_parameters_path is not None,
        "--check-weight-sync": d.check_weight_sync,
        "--check-weight-update-equal": d.check_weight_update_equal,
    }
    on = [name for name, given in checks.items() if given]
    if on and _no_push(d):
        yield (
            f"{on[0]} checks the weight push from the trainer to the engines, which "
            "--debug-rollout-only / --debug-train-only never run"
        )
        return
    # The checks the engines answer themselves (the adapter push's is SGLang's own
    # expected_checksums: slime.bridge.adapter).
    adapter = c.train.lora.pushes_adapter
    reported = [
        n for n in on if n == "--debug-sync-parameters-path" or (n == "--check-weight-sync" and not adapter)
    ]
    if reported and c.cluster.rollout_backend == "sglang":
        yield (
            f"{reported[0]} needs engines that report what they wrote (the torch engine's slime extensions); "
            "SGLang does not: use --check-weight-update-equal (SGLang's /weights_checker) with SGLang "
            "engines"
        )
        return
    root = d.sync_parameters_path
    full = [p for p in ("before_sync_parameter", "after_sync_parameter") if root and _non_empty(root, p)]
    if full:
        yield (
            f"--debug-sync-parameters-path {root!r} already holds {full[0]}/ from an earlier run: "
            "choose an empty directory or remove it (nothing is overwritten)"
        )
        return
    if d.push_fault is not None and _no_push(d):
        yield (
            "--debug-push-fault breaks the weight push, which --debug-rollout-only / "
            "--debug-train-only never run"
        )


def _non_empty(root: str, part: str) -> bool:
    return os.path.isdir(os.path.join(root, part)) and bool(os.listdir(os.path.join(root, part)))


def _fault_tolerance(c: Config) -> Iterator[str]:
    if c.rollout.fault_tolerance and c.cluster.colocate and c.cluster.device != "cpu":
        yield (
            "--use-fault-tolerance with --colocate on GPUs is not built yet: a restarted engine would "
            "take its GPU memory while the trainer holds it, and the CUDA-IPC push reaches every engine "
            "or none; drop one of them"
        )


def _external(c: Config) -> Iterator[str]:
    if not c.cluster.external_engine_addrs:
        return
    if c.cluster.colocate:
        yield (
            "--colocate places launched engines beside the trainer; external engines run "
            "elsewhere: drop --colocate"
        )
    elif c.debug.train_only:
        yield (
            "--rollout-external-engine-addrs with --debug-train-only: the mode uses no engine; "
            "give one of them"
        )


def _async(c: Config) -> Iterator[str]:
    """Asynchronous rollouts (docs/async.md), and the flags that need every version pushed."""
    a, r, colocate = c.rollout.asynchrony, c.rollout, c.cluster.colocate
    if a.partial and c.train.deterministic:
        yield (
            "--partial-rollout continues requests from wherever a push or the over-sampling cut them off, "
            "which depends on timing, so two runs would differ: drop --partial-rollout or "
            "--deterministic-mode"
        )
    if a.mask_offpolicy and not a.partial:
        yield (
            "--mask-offpolicy-in-partial-rollout masks the tokens of continued requests: add "
            "--partial-rollout"
        )
    if a.fully_async and colocate:
        yield (
            "--fully-async generates while the trainer trains, so the engines need GPUs of their own: drop "
            "--colocate (or use train_async.py without --fully-async, or train.py)"
        )
    if a.fully_async and r.rollout_function_path is not None:
        yield (
            "--fully-async runs the built-in rollout continuously; --rollout-function-path replaces it: "
            "give one of them (a per-sample --custom-generate-function-path works with --fully-async)"
        )
    if c.train.loss.keep_old_actor and (a.fully_async or a.partial):
        yield (
            "--keep-old-actor takes each rollout's old log-probs with the one weight version that "
            f"generated it; {'--fully-async' if a.fully_async else '--partial-rollout'} mixes versions "
            "within a rollout: drop one of them"
        )
    batch = c.train.batch
    if batch.balance_by_flops and not batch.use_dynamic_batch_size:
        yield (
            "--balance-by-flops balances dynamic micro-batches: add --use-dynamic-batch-size (and "
            "--max-tokens-per-gpu)"
        )
    if c.bridge.update_weights_interval > 1 and colocate:
        yield (
            "--update-weights-interval: colocated engines give their weights' memory up while the trainer "
            "trains and take it back with each push, so every rollout must push: drop "
            "--update-weights-interval or --colocate"
        )
    elif c.bridge.update_weights_interval > 1 and a.fully_async:
        yield (
            "--update-weights-interval: --fully-async bounds staleness with --max-policy-version-lag and "
            "pushes after every step; drop --update-weights-interval"
        )


def _global_dataset(c: Config) -> Iterator[str]:
    """--disable-rollout-global-dataset: only a rollout function that brings its own data runs without one."""
    if c.rollout.global_dataset:
        return
    if c.rollout.rollout_function_path is None:
        yield (
            "--disable-rollout-global-dataset leaves the built-in rollout without prompts: give a "
            "--rollout-function-path that brings its own data, or drop the flag"
        )
    elif c.rollout.num_rollout is None:
        yield (
            "--disable-rollout-global-dataset: --num-epoch counts passes over the dataset; give --num-rollout"
        )


def _delta(c: Config) -> Iterator[str]:
    """--update-weight-mode delta and the disk transport's directories."""
    b = c.bridge
    if b.mode != "delta":
        if b.local_dir:
            yield (
                "--update-weight-local-checkpoint-dir is the engine hosts' checkpoint of "
                "--update-weight-mode delta; full disk pushes are read from --update-weight-disk-dir "
                "directly: drop it, or add --update-weight-mode delta"
            )
        return
    missing = [
        f
        for f, v in (
            ("--update-weight-disk-dir", b.disk_dir),
            ("--update-weight-local-checkpoint-dir", b.local_dir),
        )
        if not v
    ]
    if b.transport != "disk":
        yield (
            "--update-weight-mode delta publishes to disk: use --update-weight-transport disk, not "
            f"{b.transport}"
        )
    elif c.cluster.colocate:
        yield (
            "--update-weight-mode delta: colocated engines take the weights in place through CUDA IPC, "
            "where a delta saves nothing: drop --update-weight-mode delta or --colocate"
        )
    elif missing:
        yield (
            f"--update-weight-mode delta needs {' and '.join(missing)}: where versions are published (a "
            "directory every engine host reads) and each host's own checkpoint (local disk)"
        )
    elif c.train.lora.enabled:
        yield (
            "--update-weight-mode delta pushes full weights' changes; with --lora-rank push the "
            "adapters or merged weights"
        )
    else:
        assert b.disk_dir and b.local_dir
        problem = delta_dirs_problem(c.train.hf_checkpoint, b.disk_dir, b.local_dir)
        yield from [problem] if problem else []


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


def _required(c: Config) -> Iterator[str]:
    """What a run cannot do without: the rollout size, the prompts, how long to train."""
    r, replay = c.rollout, c.debug.load_rollout_data is not None
    if not r.rollout_batch_size and not replay:
        yield "--rollout-batch-size is required (prompts per rollout)"
    if r.data is None and r.rollout_function_path is None and not replay:
        yield "--prompt-data is required (or a --rollout-function-path that brings its own data)"
    if r.num_rollout is None and r.num_epoch is None:
        yield "give --num-rollout or --num-epoch (how long to train)"
    elif r.num_rollout is None and r.data is None:
        yield "--num-epoch counts passes over --prompt-data; without it give --num-rollout"


def _layout(c: Config) -> Iterator[str]:
    """The processes, the engines, the weight push and the router."""
    k = c.cluster
    if k.rollout_num_gpus % k.rollout_num_gpus_per_engine:
        yield (
            f"--rollout-num-gpus {k.rollout_num_gpus} is not a multiple of --rollout-num-gpus-per-engine "
            f"{k.rollout_num_gpus_per_engine}"
        )
    from slime.config.rollout import transport_problem

    problem = transport_problem(c.bridge.transport, k.device, k.colocate)
    if problem is not None:
        yield problem
    if (k.router_ip is None) != (k.router_port is None):
        yield "--sglang-router-ip and --sglang-router-port go together: give both, or neither"
    if k.rollout_backend == "torch" and k.rollout_num_gpus_per_engine != 1:
        yield "--rollout-backend torch runs tensor-parallel size 1: use --rollout-num-gpus-per-engine 1"
    if k.rollout_backend == "torch" and any(d.sampling.min_new_tokens for d in c.eval.datasets):
        yield (
            "--eval-min-new-tokens is SGLang's min_new_tokens, which the torch engine does not "
            "apply: use --rollout-backend sglang"
        )
    if c.train.fsdp.disable_sharding and k.num_train_ranks != 1 and not c.debug.rollout_only:
        yield (
            f"--debug-disable-sharding runs one unsharded train rank, but --actor-num-nodes × "
            f"--actor-num-gpus-per-node is {k.num_train_ranks}: set both to 1"
        )
    if k.colocate and k.rollout_num_gpus != k.num_train_ranks:
        yield (
            f"--colocate puts engines on the trainer's {k.num_train_ranks} devices, but --rollout-num-gpus "
            f"is {k.rollout_num_gpus}; drop --rollout-num-gpus or make them equal"
        )
    over = c.rollout.over_sampling_batch_size
    if over is not None and over < c.rollout.rollout_batch_size:
        yield "--over-sampling-batch-size must be >= --rollout-batch-size"


def _rewards(c: Config) -> Iterator[str]:
    """The reward, saving and evaluating, the loggers and the files named."""
    r = c.rollout
    scored_by_plugin = r.rollout_function_path or r.custom_generate_function_path  # may set rewards
    if (
        r.rm_type is None
        and r.custom_rm_path is None
        and not scored_by_plugin
        and c.debug.load_rollout_data is None
    ):
        yield (
            "choose a reward: --rm-type TYPE (math, deepscaler, dapo, ...) or --custom-rm-path "
            "package.module.function"
        )
    if needs_reward_key(r.rm_type) and not r.custom_rm_path and r.reward_key is None:
        yield (
            f"--rm-type {r.rm_type} returns a dict {{score, acc, pred}}: add --reward-key score (as "
            "slime's scripts do)"
        )
    if c.checkpoint.save_interval is not None and c.checkpoint.save is None:
        yield "--save-interval needs --save DIR"
    if c.eval.interval is not None and not c.eval.datasets:
        yield "--eval-interval needs --eval-prompt-data (or --eval-config)"
    missing = check_available(c.logging.use_wandb, c.logging.use_tensorboard)
    if missing:
        yield missing
    if r.data is not None and not os.path.isfile(r.data.prompt_data):
        yield f"--prompt-data {r.data.prompt_data!r}: no such file"
    source = "--eval-prompt-data" if c.eval.config_path is None else f"--eval-config {c.eval.config_path}:"
    for dataset in c.eval.datasets:
        if not os.path.isfile(dataset.data.prompt_data):
            yield f"{source} {dataset.data.prompt_data!r}: no such file"


def _schedule(c: Config) -> Iterator[str]:
    """The batch arithmetic and the Megatron flags."""
    samples = c.rollout.rollout_batch_size * c.rollout.sampling.n_samples_per_prompt
    batch = c.train.batch
    if c.debug.rollout_only or c.debug.load_rollout_data is not None:
        pass  # no trainer, or the dumps decide the rollout size: checked when training starts
    elif batch.global_batch_size is not None and samples % batch.global_batch_size:
        yield (
            f"--rollout-batch-size × --n-samples-per-prompt = {samples} samples per rollout, "
            f"not a multiple of --global-batch-size {batch.global_batch_size}"
        )
    elif batch.num_steps_per_rollout is not None and samples % batch.num_steps_per_rollout:
        yield (
            f"{samples} samples per rollout cannot be split into --num-steps-per-rollout "
            f"{batch.num_steps_per_rollout}"
        )
    problem = megatron_problem(c)
    if problem:
        yield problem


def megatron_flags() -> dict[str, object]:
    """Each Megatron flag's field and default (MegatronConfig's). --expert-tensor-parallel-size
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


def megatron_problem(c: Config) -> str | None:
    """The Megatron layout against the train ranks; what the Megatron actor builds and the model
    allows (heads, layers, experts) is its own check (slime.backends.megatron.settings.
    layout_problem), in the job's validation pass."""
    megatron, backend = c.train.megatron, c.cluster.train_backend
    given = [f"--{k.replace('_', '-')}" for k, v in megatron_flags().items() if getattr(megatron, k) != v]
    if backend != "megatron":
        if not given:
            return None
        return (
            f"{', '.join(given)} configure --train-backend megatron; with --train-backend {backend} drop them"
        )
    if c.train.lora.enabled and megatron.transformer_impl == "transformer_engine":
        from slime.config.lora import MEGATRON_TE

        return MEGATRON_TE
    ranks = c.cluster.num_train_ranks
    tp, pp = megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size
    cp = megatron.context_parallel_size
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
    # The FSDP-only flags given: their fields off their defaults (Megatron has no vision tower either).
    fields = {spec.name: f for f, spec in flags_of(FSDPConfig)}
    fsdp_only = [
        flag for flag in FSDP_ONLY if getattr(c.train.fsdp, fields[flag].name) != fields[flag].default
    ]
    if fsdp_only:
        return f"{', '.join(fsdp_only)} configure the FSDP backend; with --train-backend megatron drop them"
    return None
