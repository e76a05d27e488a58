"""`--dry-run`: everything a start checks without starting a process, then the plan.

No Ray, no engine, no weights: the flags and their rules, the architecture flags against the HF
config, the inputs (checkpoint configs and tokenizers, prompt and eval files, function paths,
rewards), the batch arithmetic and the placement. Exit 0 with the resolved configuration and the
plan on stdout, or exit 2 listing every problem found.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import TYPE_CHECKING

from slime.config.resolve import Resolution

if TYPE_CHECKING:
    from slime.config.arguments import Config


def dry_run(ns: argparse.Namespace, config: Config | None, found: list[str], resolution: Resolution) -> int:
    warnings: list[str] = []
    if config is not None:
        from slime.ray.inputs import input_problems

        # A file the flag checks found missing is not reported again by the input checks.
        missing = {m.group(1) for p in found if (m := re.search(r"'([^']+)': no such file", p))}
        found = found + [
            p for p in input_problems(config, weights=False, reach=False) if not any(m in p for m in missing)
        ]
        warnings += _weight_warnings(config)
        if not found:
            found += _batch_problems(config)
    report = ["slime --dry-run: nothing is started", "resolved:"]
    report += [f"  {line}" for line in resolution.lines + _no_effect(ns)]
    if found:
        report.append(f"{len(found)} problem{'s' if len(found) > 1 else ''}:")
        report += [f"  - {problem}" for problem in found]
    else:
        assert config is not None
        report += plan(config, ns) + [f"warning: {w}" for w in warnings]
    # The report is the command's output (as --help is), read from stdout: not a log record.
    sys.stdout.write("\n".join(report) + "\n")  # the report is the command's output
    return 2 if found else 0


def _no_effect(ns: argparse.Namespace) -> list[str]:
    from slime.config.derived import no_effect_lines

    return no_effect_lines(ns)


def _weight_warnings(config: Config) -> list[str]:
    from slime.backends.hf_checkpoint import weight_files

    out = []
    for flag, path in (
        ("--hf-checkpoint", config.train.hf_checkpoint),
        ("--ref-load", config.train.ref_load),
    ):
        if path and os.path.isdir(path) and not weight_files(path):  # a missing one is a problem already
            out.append(f"{flag} {path} has no weight files here (read at launch, not by --dry-run)")
    return out


def _dp_size(config: Config) -> int:
    from slime.ray.placement import data_parallel_size

    return data_parallel_size(config)


def _batch_problems(config: Config) -> list[str]:
    r, b = config.rollout, config.train.batch
    if config.debug.rollout_only or config.debug.load_rollout_data:
        return []
    samples = r.rollout_batch_size * r.sampling.n_samples_per_prompt
    try:
        b.check_layout(_dp_size(config), b.global_batch_for(samples))
    except ValueError as e:
        return [str(e)]
    return []


def plan(config: Config, ns: argparse.Namespace) -> list[str]:
    r = config.rollout
    out = ["plan:"]
    out += [f"  {line}" for line in _model_lines(config, ns)]
    if not config.debug.load_rollout_data:
        samples = r.rollout_batch_size * r.sampling.n_samples_per_prompt
        total = (
            f"{r.num_rollout} rollouts"
            if r.num_rollout is not None
            else f"{r.num_epoch} epochs of --prompt-data"
        )
        out.append(
            f"  rollout: {r.rollout_batch_size} prompts x {r.sampling.n_samples_per_prompt} samples = "
            f"{samples} samples per rollout; {total}"
        )
        if not config.debug.rollout_only:
            out += [f"  {line}" for line in _train_lines(config, samples)]
    if config.eval.datasets:
        from slime.config.eval_sets import describe

        when = (
            f"every {config.eval.interval} rollouts" if config.eval.interval else "never (no --eval-interval)"
        )
        out.append(f"  eval {when}: {describe(config.eval.datasets)}")
    out.append(f"  weight push: --update-weight-transport {config.bridge.transport}")
    out.append("placement:")
    out += [f"  {line}" for line in placement_lines(config, ns)]
    return out


def _model_lines(config: Config, ns: argparse.Namespace) -> list[str]:
    from transformers import AutoConfig

    from slime.config import architecture

    t = config.train
    hf = AutoConfig.from_pretrained(t.hf_checkpoint)
    arch = architecture.hf_architecture(hf).values
    given = architecture.count_architecture_flags(ns)
    lines = [
        f"model: {t.hf_checkpoint} ({hf.model_type}: {arch['num_layers']} layers, hidden "
        f"{arch['hidden_size']}, {arch['num_attention_heads']} heads / {arch['num_query_groups']} "
        f"key-value, vocab {arch['vocab_size']}"
        + (
            f", {arch['num_experts']} experts, {arch['moe_router_topk']} per token"
            if arch["num_experts"]
            else ""
        )
        + "); "
        + (f"its {given} architecture flags agree with it" if given else "no architecture flags")
    ]
    if t.backend == "megatron":
        precision = (
            "bfloat16 (--bf16)" if t.megatron.bf16 else "float32 (slime trains Megatron in bf16: add --bf16)"
        )
    else:
        precision = f"parameters {t.fsdp.param_dtype}, reductions {t.fsdp.reduce_dtype}"
    lines.append(f"precision: {precision}")
    return lines


def _train_lines(config: Config, samples: int) -> list[str]:
    t, b = config.train, config.train.batch
    dp = _dp_size(config)
    gbs = b.global_batch_for(samples)
    steps = samples // gbs
    per_rank = gbs // dp
    if t.backend == "megatron":
        m = t.megatron
        layout = (
            f"{config.cluster.num_train_ranks} ranks = TP {m.tensor_model_parallel_size} x PP "
            f"{m.pipeline_model_parallel_size} x CP {m.context_parallel_size} x DP {dp}"
        )
    else:
        layout = f"{config.cluster.num_train_ranks} ranks = DP {dp} (FSDP shards over all)"
    if b.use_dynamic_batch_size:
        unit = "tokens (padded size)" if b.padded_micro_batches else "real tokens"
        micro = f"micro-batches of at most {b.max_tokens_per_gpu} {unit} (--max-tokens-per-gpu)"
    else:
        micro = f"{per_rank // b.micro_batch_size} micro-batches of {b.micro_batch_size}"
    micro += (
        ", one right-padded row per sample (--padded-micro-batches)"
        if b.padded_micro_batches
        else ", each packed into one row without padding"
    )
    if b.log_probs_chunk_size > 0:
        micro += f"; log-softmax over the vocabulary {b.log_probs_chunk_size} tokens at a time"
    total = f", {steps * config.rollout.num_rollout} in all" if config.rollout.num_rollout is not None else ""
    o = t.optimizer
    lines = [
        f"train: {t.backend}, {layout}",
        f"  global batch {gbs} samples -> {steps} optimizer step(s) per rollout{total}; each data-parallel "
        f"rank takes {per_rank} samples per step in {micro}",
        f"  optimizer: {o.optimizer}, lr {o.lr:g} ({o.lr_decay_style}; warm-up {o.lr_warmup_iters} steps"
        + (f", decay over {o.lr_decay_iters}" if o.lr_decay_iters else "")
        + ")",
        f"  loss: {t.loss.loss_type}, advantages {t.loss.advantage_estimator}"
        + (f", KL loss {t.loss.kl_loss_type} x {t.loss.kl_loss_coef:g}" if t.loss.use_kl_loss else ""),
    ]
    return lines


def placement_lines(config: Config, ns: argparse.Namespace) -> list[str]:
    """Which node and device holds which train rank and engine (Ray packs the bundles in order onto
    nodes of --num-gpus-per-node devices, default --actor-num-gpus-per-node)."""
    from slime.ray.placement import job_placement

    c = config.cluster
    placement = job_placement(config)
    per_node = ns.num_gpus_per_node or c.actor_num_gpus_per_node
    unit = "GPU" if c.device == "cuda" else "CPU process"
    nodes: dict[int, list[str]] = {}
    for rank, slot in enumerate(placement.train):
        b = slot.bundles[0]
        nodes.setdefault(b // per_node, []).append(f"train rank {rank}: {unit} {b % per_node}")
    named = [(f"engine {j}", slot) for j, slot in enumerate(placement.engines)]
    for name, slot in named + [("OPD teacher engine", slot) for slot in placement.teacher]:
        where = ",".join(str(b % per_node) for b in slot.bundles)
        spans = {b // per_node for b in slot.bundles}
        text = f"{name}: {unit} {where}" + (" (SPANS NODES)" if len(spans) > 1 else "")
        nodes.setdefault(min(spans), []).append(text)
    for rank, slot in enumerate(placement.critic):
        b = slot.bundles[0]
        nodes.setdefault(b // per_node, []).append(f"critic rank {rank}: {unit} {b % per_node}")
    units = "GPUs" if c.device == "cuda" else "CPU processes"
    out = [
        f"{placement.num_bundles} {units} in bundles of one, {per_node} per node; "
        f"{'colocated' if c.colocate else 'disaggregated'}"
    ]
    for node in sorted(nodes):
        out.append(f"node {node}: " + "; ".join(nodes[node]))
    if c.external_engine_addrs:
        out.append(f"external engines: {', '.join(c.external_engine_addrs)}")
    if c.colocate:
        trainer = (
            "the trainer gives its memory up while engines generate"
            if c.offload
            else "the trainer keeps its memory"
        )
        engines = (
            "engines release memory -> train -> push -> engines take their memory back"
            if c.offload_rollout
            else "train (engines keep their memory: --no-offload-rollout) -> push"
        )
        out.append(
            "order: engines start first (they size their memory from what is free), then the train ranks; "
            f"every step: {engines}; {trainer}"
        )
    return out
