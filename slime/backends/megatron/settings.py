"""What the Megatron actor builds and refuses: megatron-core's recompute settings from the flags,
and the layouts and options refused at start-up (exit 2; the job's validation pass checks them
too, before any process starts: `layout_problem`)."""

from __future__ import annotations

import argparse
import os
from typing import Any

from slime.backends.megatron.convert import ConversionError, Layout


def recompute_settings(cfg: Any) -> dict[str, Any]:
    """megatron-core's recompute: Megatron-LM's --recompute-* flags, or --gradient-checkpointing
    (full recompute of every layer in backward)."""
    model = cfg.model
    if model.recompute_granularity == "selective":
        return {"recompute_granularity": "selective"}
    if model.recompute_granularity == "full":
        return {
            "recompute_granularity": "full",
            "recompute_method": model.recompute_method or "uniform",
            "recompute_num_layers": model.recompute_num_layers or 1,
        }
    if cfg.fsdp.gradient_checkpointing:
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {}


def transformer_settings(cfg: Any, cpu_init: bool) -> dict[str, Any]:
    """megatron-core's TransformerConfig settings that the flags give (the model's shapes come
    from its Hugging Face config: slime.backends.megatron.model.transformer_config)."""
    m = cfg.megatron
    return dict(
        cpu_init=cpu_init,
        bf16=m.bf16,
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        expert_model_parallel_size=m.expert_model_parallel_size,
        expert_tensor_parallel_size=m.etp,
        context_parallel_size=m.context_parallel_size,
        router_dtype=cfg.moe.moe_router_dtype,
        sequence_parallel=m.sequence_parallel,
        # Micro-batches differ in length and size: the pipeline exchanges shapes first.
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # megatron-core refuses its default with variable lengths
        # The loss function returns each micro-batch's share of the global loss already.
        calculate_per_token_loss=True,
        **recompute_settings(cfg),
        attention_dropout=cfg.model.attention_dropout,
        hidden_dropout=cfg.model.hidden_dropout,
        attention_softmax_in_fp32=cfg.model.attention_softmax_in_fp32,
    )


def check_moe(m: Any, layout: Layout, moe: Any = None) -> str | None:
    """What megatron-core's MoE layer does not train, and a MoE option given with a dense model
    (refused at start-up, exit 2; parse_args refuses those flags by name first)."""
    if moe is not None and not layout.num_experts and moe.needs_moe:
        return (
            f"{moe.needs_moe} needs a mixture-of-experts model; the --hf-checkpoint model has no "
            "routed experts"
        )
    if moe is not None and moe.moe_router_bias_update_rate > 0 and not layout.expert_bias:
        return moe.no_expert_bias(f"the --hf-checkpoint model ({layout.model_type})")
    replay = moe is not None and (moe.use_routing_replay or moe.use_rollout_routing_replay)
    if replay and moe.moe_router_bias_update_rate > 0:
        flag = "--use-routing-replay" if moe.use_routing_replay else "--use-rollout-routing-replay"
        return (
            f"{flag} with --moe-router-bias-update-rate is not built with --train-backend megatron: "
            "megatron-core counts the experts it chose, before the replay, for the bias update (the "
            "FSDP backend counts the replayed ones); use --train-backend fsdp, or one of the two"
        )
    if moe is not None and layout.num_experts and not router_hooks(layout):
        from slime.utils import model_families

        # megatron-core routes in float32 with --moe-router-dtype fp32 (its own setting, no hook)
        flag = moe.needs_router_hooks(router_fp32=True)
        if flag:
            return f"{flag}: {model_families.refusal(layout.model_type, 'router_hooks')}"
    if moe is not None and layout.num_experts and m.context_parallel_size > 1 and router_hooks(layout):
        import dataclasses  # (the router dtype is megatron-core's own setting here, no hook)

        flag = dataclasses.replace(moe, moe_router_dtype=None).needs_router_hooks(router_fp32=False)
        if flag:
            return (
                f"{flag} with --context-parallel-size {m.context_parallel_size} is not built: the router "
                "hooks record and replay whole sequences, which a CP rank does not hold"
            )
    if layout.num_experts and m.tensor_model_parallel_size > 1 and not m.sequence_parallel:
        return (
            f"--tensor-model-parallel-size {m.tensor_model_parallel_size} with a mixture-of-experts model "
            "needs --sequence-parallel (megatron-core trains MoE layers under TP only with it)"
        )
    return None


def router_hooks(layout: Layout) -> bool:
    """Whether the actor hooks the routers of this MoE layout (routing replay, the aux loss): every
    family of the registry with routed experts (docs/models.md)."""
    from slime.utils import model_families

    return model_families.refusal(layout.model_type, "router_hooks") is None


def check_supported(m: Any, installed: bool = True) -> str | None:
    """What this actor does not build yet (refused at start-up, exit 2). `installed`: also check
    that Transformer Engine is here when the settings need it (parse_args checks the packages
    itself: slime.config.resolve.package_problems)."""
    if installed:
        from slime.config.resolve import transformer_engine_problem

        problem = transformer_engine_problem(m.transformer_impl)
        if problem:
            return problem
    if m.sequence_parallel and m.transformer_impl == "local":
        return (
            "--sequence-parallel needs --transformer-impl transformer_engine: megatron-core's local layer "
            "spec normalises with torch's norms, which cannot split the sequence"
        )
    return None


def layout_problem(ns: argparse.Namespace) -> str | None:
    """--train-backend megatron's flags against what this actor builds and the --hf-checkpoint
    model allows (TP dividing the heads, PP the layers, EP the experts; MoE options with a dense
    model): the first problem, or None. The rules between settings (slime.config.checks.megatron_problem)
    have passed."""
    from slime.config.flags import from_flags
    from slime.config.train import MegatronConfig

    try:
        megatron = from_flags(MegatronConfig, ns)
    except ValueError as e:
        return str(e)
    if ns.hf_checkpoint and os.path.isfile(os.path.join(ns.hf_checkpoint, "config.json")):
        from transformers import AutoConfig

        try:
            layout = Layout.from_hf_config(
                AutoConfig.from_pretrained(ns.hf_checkpoint),
                ns.make_vocab_size_divisible_by,
                stages=megatron.stage_layers,
                mtp_layers=megatron.mtp_num_layers or 0,
            )
            layout.check_parallel(
                megatron.tensor_model_parallel_size,
                megatron.pipeline_model_parallel_size,
                megatron.expert_model_parallel_size,
                megatron.etp,
            )
        except (ConversionError, ValueError) as e:
            return f"--hf-checkpoint {ns.hf_checkpoint}: {e}"
        from slime.config.moe import MoEOptions

        try:
            moe = from_flags(MoEOptions, ns)
        except ValueError:
            moe = None  # its own check names the flag
        problem = check_moe(megatron, layout, moe)
        if problem:
            return problem
    return check_supported(megatron, installed=False)  # packages: slime.config.resolve.package_problems
