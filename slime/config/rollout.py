"""Rollout-side configuration: prompt data, sampling, weight transports and their rules (no
heavy imports). The rule "`tensor` on CUDA is CUDA IPC" lives here and nowhere else
(`resolve_kind`); slime.bridge.topology builds the push from it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from slime.config.flags import flag
from slime.utils.errors import UsageError
from slime.utils.sampling_params import FieldError, SamplingParams

TRANSPORTS = ("tensor", "distributed", "disk")
BOXED_PREFIX = "boxed_"
"""`--rm-type boxed_<type>`: <type>'s reward on the response's last \\boxed{} answer
(slime.rollout.rm_hub)."""


def needs_reward_key(rm_type: str | None) -> bool:
    """Whether the type's reward is a dict (dapo's {score, acc, pred}): training on it needs
    --reward-key to name the entry."""
    return (rm_type or "").removeprefix(BOXED_PREFIX) == "dapo"


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (argparse type)."""
    import argparse
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): give a JSON object") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"give a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class DataConfig:
    """How prompt rows become prompts (slime's flag names)."""

    prompt_data: str = flag("--prompt-data")
    """jsonl or parquet prompts"""
    input_key: str = flag("--input-key", "prompt")
    """`--input-key`: field holding the prompt (text, or a list of chat messages)."""
    label_key: str | None = flag("--label-key", "label")
    """`--label-key`: field holding the reference answer (None: no labels)."""
    metadata_key: str | None = flag("--metadata-key", "metadata")
    """`--metadata-key`: optional field passed through to reward functions."""
    apply_chat_template: bool = flag("--apply-chat-template", False)
    """`--apply-chat-template`: format prompts with the tokenizer's chat template."""
    apply_chat_template_kwargs: Mapping[str, Any] | None = flag(
        "--apply-chat-template-kwargs", None, type=json_object, metavar="JSON"
    )
    """with --apply-chat-template: more arguments of the tokenizer's apply_chat_template, a JSON
    object (e.g. '{"enable_thinking": false}')"""
    tool_key: str | None = flag("--tool-key", "tools")
    """the field holding a row's tool schemas (a list, or its JSON text): given to the chat template
    (tools=...) and to rollout functions as metadata['tools']"""
    multimodal_keys: Mapping[str, str] | None = flag(
        "--multimodal-keys", None, type=json_object, metavar="JSON"
    )
    """vision-language prompts: a JSON object from a modality to the row field holding its list of
    items, e.g. '{"image": "images"}'; each <image> in the prompt's text takes the next image (a
    path, data URL, base64 or URL). Needs --apply-chat-template"""
    max_prompt_len: int | None = flag("--rollout-max-prompt-len", None, type=int, group="rollout")
    """`--rollout-max-prompt-len`: drop longer prompts (in tokens)."""
    shuffle: bool = flag("--rollout-shuffle", False)
    """`--rollout-shuffle`: reshuffle the prompts at every epoch."""
    seed: int = flag("--rollout-seed", 42)
    """`--rollout-seed`: the seed of the prompts' order (--rollout-shuffle)."""
    messages_as_is: bool = False
    """List prompts without `--apply-chat-template` are kept as messages, untokenized, and a row
    may have no label (set when a `--rollout-function-path` handles the rows itself, as slime's
    SFT rollout does)."""

    def __post_init__(self) -> None:
        keys = self.multimodal_keys
        if keys is None:
            return
        if not isinstance(keys, Mapping) or not all(isinstance(v, str) for v in keys.values()):
            raise ValueError(
                f'--multimodal-keys must map a modality to a field name, e.g. {{"image": "images"}}; '
                f"got {keys!r}"
            )
        if not self.apply_chat_template:
            raise ValueError(
                "--multimodal-keys needs --apply-chat-template (the chat template places the images)"
            )
        if set(keys) - {"image"}:
            raise ValueError(
                f"--multimodal-keys: {sorted(set(keys) - {'image'})} not supported (images only: "
                "'{\"image\": FIELD}')"
            )


@dataclass(frozen=True)
class SamplingConfig:
    """How responses are sampled (slime's flag names)."""

    n_samples_per_prompt: int = flag("--n-samples-per-prompt", 1)
    """`--n-samples-per-prompt`: responses sampled for each prompt (a group: GRPO's baseline)."""
    temperature: float = 1.0
    """`--rollout-temperature`."""
    top_p: float = flag("--rollout-top-p", 1.0)
    """`--rollout-top-p`: nucleus sampling's probability mass (1: off)."""
    top_k: int = flag("--rollout-top-k", -1)
    """`--rollout-top-k`: sample among the k likeliest tokens (-1: off)."""
    max_response_len: int = flag("--rollout-max-response-len", 1024)
    """`--rollout-max-response-len`: max new tokens per response."""
    stop: tuple[str, ...] = flag("--rollout-stop", [], nargs="*")
    """`--rollout-stop`: stop strings."""
    stop_token_ids: tuple[int, ...] = flag("--rollout-stop-token-ids", [], nargs="*", type=int)
    """`--rollout-stop-token-ids`: token ids that end a response (besides the tokenizer's EOS)."""
    min_new_tokens: int | None = None
    """An evaluation set's `min_new_tokens` (--eval-min-new-tokens): SGLang engines only."""

    def params(self) -> dict[str, Any]:
        """A request's `sampling_params` (SGLang's names; slime.utils.sampling_params)."""
        return {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "max_new_tokens": self.max_response_len,
            "stop": list(self.stop),
            "stop_token_ids": list(self.stop_token_ids),
            **({"min_new_tokens": self.min_new_tokens} if self.min_new_tokens is not None else {}),
        }

    def refused(self) -> FieldError | None:
        """What an engine would refuse in every request of these settings (the engines' own
        check), its `field` the record's (`max_response_len`, `top_p`, ...); None if nothing."""
        try:
            SamplingParams.from_json({k: v for k, v in self.params().items() if k != "min_new_tokens"})
        except FieldError as e:
            name = e.field.removeprefix("sampling_params.").removesuffix("[]")
            return FieldError({"max_new_tokens": "max_response_len"}.get(name, name), e.reason)
        return None


class TopologyError(UsageError):
    """A push that cannot work as described; the message names the flag and the fix."""


def resolve_kind(transport: str, device: str) -> str:
    """The transport as it runs. `tensor` is shared memory on CPU and the CUDA-IPC push on CUDA;
    `ipc` (not a command-line choice) asks for the IPC push's code path on either device."""
    if transport == "tensor":
        return "ipc" if device == "cuda" else "shared_memory"
    if transport in ("ipc", "distributed", "disk"):
        return transport
    raise TopologyError(f"--update-weight-transport {transport!r} is not one of {', '.join(TRANSPORTS)}")


def default_transport(device: str, colocate: bool) -> str:
    """--update-weight-transport's default: a NCCL group for GPU engines on GPUs of their own, else
    `tensor` (CUDA IPC for colocated GPU engines, shared memory on CPU)."""
    return "distributed" if device == "cuda" and not colocate else "tensor"


def transport_problem(transport: str, device: str, colocate: bool) -> str | None:
    """What the flags alone rule out, before anything is placed: one message, or None."""
    try:
        kind = resolve_kind(transport, device)
    except TopologyError as e:
        return str(e)
    if kind == "ipc" and device == "cuda" and not colocate:
        return (
            f"--update-weight-transport {transport} on GPU shares CUDA-IPC handles, which only engines on "
            "the train ranks' own GPUs can open: add --colocate, or use --update-weight-transport "
            "distributed"
        )
    if kind == "distributed" and device == "cuda" and colocate:
        return (
            "--update-weight-transport distributed with --colocate puts train rank 0 and engine 0's first "
            "TP worker, both on one GPU, into one NCCL group, which NCCL refuses (duplicate GPU): use "
            "--update-weight-transport tensor (CUDA IPC) or disk"
        )
    return None
