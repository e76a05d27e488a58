"""The Hugging Face checkpoint a job starts from, read and checked the same way by both train
backends and by the job's start-up checks: one clear error naming the flag and the fix."""

from __future__ import annotations

import os
from typing import Any

from slime.utils.errors import UsageError
from slime.utils.model_families import is_vision


class CheckpointError(UsageError):
    """An --hf-checkpoint/--ref-load directory the trainer cannot use."""


def check_hf_checkpoint(path: str, flag: str = "--hf-checkpoint", weights: bool = True) -> Any:
    """Load and sanity-check a checkpoint's config; returns it.

    Refuses a missing directory, one without config.json or weights, a config that is not a
    causal LM, and a config whose vocab_size is smaller than its tokenizer's vocabulary.
    """
    from transformers import AutoConfig, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not os.path.isdir(path):
        raise CheckpointError(f"{flag} {path!r} is not a directory")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise CheckpointError(f"{flag} {path!r} has no config.json: not a Hugging Face checkpoint")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as e:  # transformers raises many types for bad configs
        raise CheckpointError(f"{flag} {path!r}: config.json cannot be read ({e})") from e
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not is_vision(config.model_type):
        raise CheckpointError(
            f"{flag} {path!r}: model_type {config.model_type!r} is not a causal language model "
            "(AutoModelForCausalLM cannot build it)"
        )
    if weights and not weight_files(path):
        raise CheckpointError(f"{flag} {path!r} has no *.safetensors or pytorch_model*.bin weights")
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if any(os.path.exists(os.path.join(path, f)) for f in tokenizer_files):
        tokenizer = AutoTokenizer.from_pretrained(path)
        vocab_size = config.get_text_config().vocab_size
        if len(tokenizer) > vocab_size:
            raise CheckpointError(
                f"{flag} {path!r}: the tokenizer has {len(tokenizer)} tokens but config.json says "
                f"vocab_size={vocab_size}; token ids past {vocab_size - 1} would index "
                "outside the embedding (use the tokenizer that belongs to these weights)"
            )
    return config


# config.json fields that change neither a parameter nor the forward's math on trained weights
# (attention_dropout: --attention-dropout replaces the checkpoint's).
NOT_ARCHITECTURE = frozenset(
    {
        "_name_or_path",
        "name_or_path",
        "architectures",
        "torch_dtype",
        "dtype",
        "transformers_version",
        "use_cache",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "_attn_implementation_autoset",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "initializer_range",
        "max_position_embeddings",
        "attention_dropout",
    }
)


def check_same_architecture(config: Any, path: str, flag: str, why: str) -> Any:
    """Check `path` (named by `flag`) is `config`'s model (the --hf-checkpoint's) with other
    weights: its weights then run in the student's model, so every config.json field that shapes
    a parameter or the forward (rope_theta, rms_norm_eps, the experts, ...) must agree. Returns
    its config. `why`: the fix, for the message."""
    other = check_hf_checkpoint(path, flag)
    a, b = config.to_dict(), other.to_dict()
    for name in sorted((a.keys() | b.keys()) - NOT_ARCHITECTURE):
        mine, theirs = a.get(name), b.get(name)
        if mine != theirs:
            raise CheckpointError(
                f"{flag} {path!r}: {name} is {theirs!r}, --hf-checkpoint's is {mine!r}; the weights load "
                f"into the student's model, so the architecture must be the same ({why})"
            )
    return other


def weight_files(path: str) -> list[str]:
    names = sorted(os.listdir(path))
    safetensors = [n for n in names if n.endswith(".safetensors")]
    if safetensors:
        return [os.path.join(path, n) for n in safetensors]
    return [os.path.join(path, n) for n in names if n.startswith("pytorch_model") and n.endswith(".bin")]
