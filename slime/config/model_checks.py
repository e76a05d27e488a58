"""The rules between the settings and the model --hf-checkpoint holds, read on the records: what
a model family is not built for (slime.utils.model_families) is refused by name. The architecture
flags against the checkpoint's config are compared on the command line (slime.config.derived),
since Megatron-LM's flags have no record."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from slime.config.architecture import hf_config, hf_moe
from slime.config.lora import ALL_LINEAR
from slime.config.records import Config
from slime.utils.model_families import is_vision, value_model_refusal


def model_problems(config: Config) -> Iterator[str]:
    """PPO's critic where the backend cannot build it or on prompts with images, images where the
    backend has no vision tower, an expert-bias update rate for routers without a bias, and LoRA
    where it is not built (the Megatron backend on a vision-language model, the torch engine's
    adapter on multi-latent attention's kv_b_proj)."""
    train, backend, data = config.train, config.cluster.train_backend, config.rollout.data
    if config.critic is not None:
        critic = config.critic.load or train.hf_checkpoint
        model_type = getattr(hf_config(critic), "model_type", None)
        if backend == "fsdp" and (why := value_model_refusal(model_type)):
            yield f"--advantage-estimator ppo: the critic starts from {critic}, {why}"
        elif backend != "fsdp" and is_vision(model_type):
            yield (
                f"--advantage-estimator ppo: the critic starts from {critic} (model_type {model_type!r}), a "
                "vision-language model, which the Megatron backend's critic is not built from (use "
                "--train-backend fsdp, or a critic-free estimator such as grpo)"
            )
        elif data is not None and data.multimodal_keys:
            yield (
                "--advantage-estimator ppo with --multimodal-keys: PPO's critic on prompts with images is "
                "not built (its forward takes no pixels); use grpo (or another critic-free estimator)"
            )
    if backend == "megatron" and data is not None and data.multimodal_keys:
        yield (
            "--multimodal-keys with --train-backend megatron: the Megatron backend trains a "
            "vision-language model's language model only (its vision tower is not converted); train "
            "prompts with images with --train-backend fsdp"
        )
    if train.moe.moe_router_bias_update_rate <= 0 and train.lora.rank <= 0 and not train.fsdp.torch_compile:
        return  # nothing below to check: the checkpoint's config is not read
    model = hf_config(train.hf_checkpoint)
    if model is None:
        return
    if train.fsdp.torch_compile and (why := _uncompiled_layers(model)):
        yield f"--fsdp-torch-compile with {train.hf_checkpoint} ({model.model_type}): {why}; drop the flag"
    if train.moe.moe_router_bias_update_rate > 0 and not hf_moe(model).get("moe_router_enable_expert_bias"):
        yield train.moe.no_expert_bias(f"--hf-checkpoint {train.hf_checkpoint} ({model.model_type})")
    lora = train.lora
    latent = getattr(model, "kv_lora_rank", None) is not None  # multi-latent attention

    def kv_b(names: tuple[str, ...]) -> bool:  # PEFT's rule: a name or a dotted tail
        return any(n.rsplit(".", 1)[-1] == "kv_b_proj" for n in names)

    if (
        lora.pushes_adapter
        and latent
        and (ALL_LINEAR in lora.target_modules or kv_b(lora.target_modules))
        and not kv_b(lora.exclude_modules)
        and config.cluster.rollout_backend == "torch"
    ):
        yield (
            f"--lora-push adapter with --target-modules {','.join(lora.target_modules)} on "
            f"{train.hf_checkpoint} ({model.model_type}, multi-latent attention): the torch engine computes "
            "kv_b_proj in the absorbed form, where it applies no adapter; add --exclude-modules kv_b_proj, "
            "or use --lora-push merged"
        )
    if train.lora.rank > 0 and backend == "megatron" and is_vision(model.model_type):
        yield (
            f"--lora-rank with --train-backend megatron and {train.hf_checkpoint} (model_type "
            f"{model.model_type!r}, vision-language): the Megatron backend's adapters are built for text "
            "models; use --train-backend fsdp"
        )


def _uncompiled_layers(model: Any) -> str | None:
    """Why --fsdp-torch-compile does not take this model's layers (None: it does). transformers'
    mixture-of-experts forward loops over the experts that received tokens, a count read from the
    device at every layer, and the linear-attention layers branch on their inputs likewise: torch
    would break their graphs at every step and compile them again and again."""
    text = model.get_text_config() if hasattr(model, "get_text_config") else model
    if hf_moe(text)["num_experts"] or getattr(text, "num_local_experts", None):  # (Mixtral's name)
        return "its mixture-of-experts layers do not compile (their expert loop depends on the data)"
    if "linear_attention" in (getattr(text, "layer_types", None) or []):
        return "its linear-attention layers do not compile (they branch on their inputs)"
    return None
