"""Rollout-side configuration: prompt data, sampling, weight transports (no heavy imports)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

TRANSPORTS = ("tensor", "distributed", "disk")


@dataclass(frozen=True)
class DataConfig:
    """How prompt rows become prompts (slime's flag names)."""

    prompt_data: str
    """`--prompt-data`: jsonl or parquet file."""
    input_key: str = "prompt"
    """`--input-key`: field holding the prompt (text, or a list of chat messages)."""
    label_key: str | None = "label"
    """`--label-key`: field holding the reference answer (None: no labels)."""
    metadata_key: str | None = "metadata"
    """`--metadata-key`: optional field passed through to reward functions."""
    apply_chat_template: bool = False
    """`--apply-chat-template`: format prompts with the tokenizer's chat template."""
    max_prompt_len: int | None = None
    """`--rollout-max-prompt-len`: drop longer prompts (in tokens)."""
    shuffle: bool = False
    """`--rollout-shuffle`: reshuffle the prompts at every epoch."""
    seed: int = 42
    """`--rollout-seed`."""
    messages_as_is: bool = False
    """List prompts without `--apply-chat-template` are kept as messages, untokenized, and a row
    may have no label (set when a `--rollout-function-path` handles the rows itself, as slime's
    SFT rollout does)."""


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled (slime's flag names)."""

    n_samples_per_prompt: int = 1
    """`--n-samples-per-prompt`."""
    temperature: float = 1.0
    """`--rollout-temperature`."""
    top_p: float = 1.0
    """`--rollout-top-p`."""
    top_k: int = -1
    """`--rollout-top-k` (-1: off)."""
    max_response_len: int = 1024
    """`--rollout-max-response-len`: max new tokens per response."""
    stop: tuple[str, ...] = ()
    """`--rollout-stop`: stop strings."""
    stop_token_ids: tuple[int, ...] = ()
    """`--rollout-stop-token-ids`."""

    def params(self) -> dict[str, Any]:
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_response_len,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
        }
