"""Rollout dumps: what `--save-debug-rollout-data` writes and `--load-debug-rollout-data` replays.

A dump is `torch.save` of

    {"format_version": 2, "rollout_id": int, "samples": [Sample.to_dict(), ...], "meta": {...}}

with only numbers, strings, lists, dicts, tensors and None inside (a sample's `trace`, slime's per-sample
spans, is such a dict too), so `torch.load(path, weights_only=True)` reads it. Samples are saved after reward
and before any normalisation, so a replay runs the whole train side. `meta` holds what a replay must match:
the tokenizer's and the model's fingerprints and the flags that shaped the rollout.

slime's `--save-debug-rollout-data` writes `{"rollout_id", "samples"}` only; slime's loader reads
the "samples" of ours (their keys are slime's field names). Ours reads slime's as format
`SLIME_FORMAT`, with `meta` {"written_by": "slime"} and a warning: nothing in it says which tokenizer made its
token ids. Version 1 dumps (one `weight_version` per sample) still load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Any

from slime.config.lora import dump_record, from_namespace
from slime.utils.errors import UsageError
from slime.utils.files import atomic_torch_save

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
SLIME_FORMAT = "slime"  # the format_version given to a dump slime wrote
TRAIN_FORMAT_VERSION = 1  # --save-debug-train-data
ROLLOUT_FLAGS = (
    "prompt_data",
    "input_key",
    "label_key",
    "apply_chat_template",
    "rollout_shuffle",
    "rollout_seed",
    "rollout_batch_size",
    "n_samples_per_prompt",
    "rollout_temperature",
    "rollout_top_p",
    "rollout_top_k",
    "rollout_max_prompt_len",
    "rollout_max_response_len",
    "rollout_stop",
    "rollout_stop_token_ids",
    "rm_type",
    "custom_rm_path",
    "group_rm",
    "reward_key",
    "custom_generate_function_path",
    "rollout_function_path",
    "over_sampling_batch_size",
    "dynamic_sampling_filter_path",
    "hf_checkpoint",
)


class DumpError(UsageError):
    """A dump that cannot be written or replayed (names the file, the field and the fix)."""


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of what decides token ids: the vocabulary, the special tokens, the chat template."""
    h = hashlib.sha256()
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(sorted(str(t) for t in tokenizer.all_special_tokens)).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    return h.hexdigest()


def model_fingerprint(hf_checkpoint: str) -> str:
    """sha256 of the checkpoint's config.json and its weight files' names and sizes (cheap: no
    weights are read)."""
    h = hashlib.sha256()
    config = os.path.join(hf_checkpoint, "config.json")
    if os.path.isfile(config):
        with open(config, "rb") as f:
            h.update(f.read())
    for name in sorted(os.listdir(hf_checkpoint)) if os.path.isdir(hf_checkpoint) else []:
        if name.endswith((".safetensors", ".bin")):
            h.update(f"{name}:{os.path.getsize(os.path.join(hf_checkpoint, name))}".encode())
    return h.hexdigest()


def make_meta(args: Any, tokenizer: Any, evaluation: bool = False) -> dict[str, Any]:
    return {
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "model_fingerprint": model_fingerprint(args.hf_checkpoint),
        "evaluation": evaluation,
        "flags": {k: _plain(getattr(args, k, None)) for k in ROLLOUT_FLAGS},
        "lora": dump_record(from_namespace(args)),
    }


def _plain(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value if value is None or isinstance(value, bool | int | float | str) else str(value)


def write_atomic(path: str, payload: dict[str, Any]) -> str:
    """torch.save into a temporary file beside `path`, renamed into place when complete."""
    atomic_torch_save(payload, path)
    return path


def save_dump(template: str, rollout_id: int, samples: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """Write one rollout's dump atomically; returns the path."""
    payload = {"format_version": FORMAT_VERSION, "rollout_id": rollout_id, "samples": samples, "meta": meta}
    return write_atomic(template.format(rollout_id=rollout_id), payload)


def load_dump(path: str, flag: str = "--load-debug-rollout-data") -> dict[str, Any]:
    """Read and check a dump's structure; DumpError names the file and what is wrong."""
    if not os.path.isfile(path):
        raise DumpError(f"{flag}: {path!r} does not exist")
    import torch

    try:
        dump = torch.load(path, weights_only=True)
    except Exception as e:
        raise DumpError(
            f"{flag}: {path!r} is not a rollout dump readable with weights_only=True ({e})"
        ) from None
    if isinstance(dump, dict) and "format_version" not in dump and isinstance(dump.get("samples"), list):
        dump = _from_slime(dump, path, flag)
    if not isinstance(dump, dict) or "format_version" not in dump:
        raise DumpError(f"{flag}: {path!r} is not a rollout dump (no format_version, no samples list)")
    if dump["format_version"] not in (*READABLE_VERSIONS, SLIME_FORMAT):
        raise DumpError(
            f"{flag}: {path!r} has format_version {dump['format_version']}; this build reads "
            f"{list(READABLE_VERSIONS)} and slime's (re-create it with --save-debug-rollout-data)"
        )
    for key, kind in (("rollout_id", int), ("samples", list), ("meta", dict)):
        if not isinstance(dump.get(key), kind):
            raise DumpError(f"{flag}: {path!r} field {key!r} is missing or not a {kind.__name__}")
    if not dump["samples"]:
        raise DumpError(f"{flag}: {path!r} holds no samples")
    for i, sample in enumerate(dump["samples"]):
        missing = [k for k in SAMPLE_KEYS if not isinstance(sample, dict) or k not in sample]
        if missing:
            raise DumpError(
                f"{flag}: {path!r} sample {i} has no {missing} (a dump holds Sample.to_dict() values)"
            )
    return dump


SAMPLE_KEYS = ("group_index", "tokens", "response_length", "reward")  # what a replay cannot do without


def is_slime_dump(dump: dict[str, Any]) -> bool:
    """Written by slime (or re-saved by a replay of such a dump): no tokenizer fingerprint."""
    meta = dump.get("meta")
    return dump.get("format_version") == SLIME_FORMAT or (
        isinstance(meta, dict) and meta.get("written_by") == "slime"
    )


def _from_slime(dump: dict[str, Any], path: str, flag: str) -> dict[str, Any]:
    """A dump slime's --save-debug-rollout-data wrote: every field is kept; `meta` says who wrote it."""
    if not isinstance(dump.get("rollout_id"), int):
        raise DumpError(f"{flag}: {path!r} has samples but no integer rollout_id: it is not a rollout dump")
    logger.warning(
        "%s: %s was written by slime: it has no format_version and no tokenizer fingerprint, so "
        "nothing checks that --hf-checkpoint's tokenizer made its token ids; its log-probs are taken "
        "at --rollout-temperature",
        flag,
        path,
    )
    return {**dump, "format_version": SLIME_FORMAT, "meta": {"written_by": "slime"}}


def check_fingerprint(dump: dict[str, Any], path: str, tokenizer: Any, allow_mismatch: bool) -> None:
    """A dump made with another tokenizer replays other token ids: refuse unless allowed."""
    if is_slime_dump(dump):
        return  # nothing to check against (load_dump warned)
    saved = dump["meta"].get("tokenizer_fingerprint")
    current = tokenizer_fingerprint(tokenizer)
    if saved != current and not allow_mismatch:
        raise DumpError(
            f"--load-debug-rollout-data: {path!r} was made with another tokenizer "
            f"(fingerprint {str(saved)[:12]}…, this --hf-checkpoint's is {current[:12]}…); "
            "replay with the checkpoint it was made with, or pass --allow-tokenizer-mismatch"
        )


def subsample(samples: list[dict[str, Any]], ratio: float) -> list[dict[str, Any]]:
    """A deterministic fraction of whole prompt groups: the first ceil(ratio * groups) groups
    after ordering them by a hash of their group index (same dump, same ratio, same subset)."""
    if ratio >= 1.0:
        return samples
    groups: dict[int, list[dict[str, Any]]] = {}
    for s in samples:
        groups.setdefault(int(s["group_index"]), []).append(s)
    order = sorted(groups, key=lambda g: hashlib.sha256(str(g).encode()).hexdigest())
    keep = set(order[: max(1, -(-int(ratio * 1e6) * len(order) // 1_000_000))])
    return [s for s in samples if int(s["group_index"]) in keep]
