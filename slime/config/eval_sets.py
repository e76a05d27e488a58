"""Named evaluation sets: `--eval-prompt-data NAME PATH [NAME PATH ...]` and `--eval-config YAML`,
with slime's schema and precedence.

    --eval-prompt-data PATH                 one unnamed set; metrics eval/<metric> (as before)
    --eval-prompt-data aime a.jsonl math m.jsonl
                                            named sets; metrics eval/<name> (mean reward),
                                            eval/<name>/<metric>, eval/<name>-truncated_ratio
    --eval-config sets.yaml                 (wins over --eval-prompt-data, as in slime)

The YAML (optionally under a top-level `eval:`) has `defaults` (a mapping) and `datasets`, either a
list of mappings with `name` and `path` or a mapping name -> settings. Each setting is taken from
the dataset entry, else from `defaults`, else from the command line: `--eval-*` first, then the
rollout's flag (`--eval-temperature`, then `--rollout-temperature`). Keys slime has for features
not built here are refused by name, as are unknown keys.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from slime.config.rollout import DataConfig, SamplingConfig, needs_reward_key

# key -> the namespace attributes it falls back to, in order.
DATA_KEYS = {
    "input_key": ("eval_input_key", "input_key"),
    "label_key": ("eval_label_key", "label_key"),
    "metadata_key": ("metadata_key",),
    "apply_chat_template": ("apply_chat_template",),
    "apply_chat_template_kwargs": ("apply_chat_template_kwargs",),
    "tool_key": ("eval_tool_key", "tool_key"),
    "multimodal_keys": ("multimodal_keys",),
}
SAMPLING_KEYS = {
    "n_samples_per_eval_prompt": ("n_samples_per_eval_prompt",),
    "temperature": ("eval_temperature", "rollout_temperature"),
    "top_p": ("eval_top_p", "rollout_top_p"),
    "top_k": ("eval_top_k", "rollout_top_k"),
    "max_response_len": ("eval_max_response_len", "rollout_max_response_len"),
    "stop": ("rollout_stop",),
    "stop_token_ids": ("rollout_stop_token_ids",),
    "min_new_tokens": ("eval_min_new_tokens",),
}
PLUGIN_KEYS = ("rm_type", "custom_rm_path", "custom_generate_function_path")
# slime's keys for what is not built here: refused by name rather than ignored.
NOT_HERE = (
    "repetition_penalty",
    "skip_special_tokens",
    "no_stop_trim",
    "metadata_overrides",
    "app_service",
    "eval_task_timeout",
    "min_eval_samples",
    "eval_early_stop_remaining",
    "eval_early_stop_idle_timeout",
    "message_processor",
    "reward_model",
    "remote_environment",
)


@dataclass(frozen=True)
class EvalDataset:
    """One evaluation set: its prompts, how they are sampled, and its reward."""

    name: str | None
    """None: the one unnamed `--eval-prompt-data PATH` (metrics `eval/...`)."""
    data: DataConfig
    sampling: SamplingConfig
    rm_type: str | None = None
    """The set's own `rm_type` (else --rm-type / --custom-rm-path)."""
    custom_rm_path: str | None = None
    """The set's own reward function (slime's key; wins over `rm_type`)."""
    custom_generate_function_path: str | None = None
    """The set's own generate function (slime's key; else --custom-generate-function-path)."""

    @property
    def prefix(self) -> str:
        return "eval" if self.name is None else f"eval/{self.name}"


def _cli(ns: argparse.Namespace, attrs: tuple[str, ...]) -> Any:
    return next((getattr(ns, a) for a in attrs if getattr(ns, a, None) is not None), None)


def _read_config(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    import yaml

    where = f"--eval-config {path}"
    try:
        with open(path) as f:
            root = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"{where}: cannot be read ({e.strerror})") from e
    except yaml.YAMLError as e:
        raise ValueError(f"{where}: not valid YAML ({e})") from e
    if not isinstance(root, dict):
        raise ValueError(
            f"{where}: the top level must be a mapping with `datasets` (optionally under `eval:`)"
        )
    section = root.get("eval", root)
    if not isinstance(section, dict):
        raise ValueError(f"{where}: `eval` must be a mapping")
    defaults = section.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise ValueError(f"{where}: `defaults` must be a mapping")
    raw = section.get("datasets")
    if isinstance(raw, dict):
        entries = [{"name": name, **(cfg or {})} for name, cfg in raw.items()]
    elif isinstance(raw, list) and raw:
        entries = list(raw)
    else:
        raise ValueError(
            f"{where}: `datasets` must be a non-empty list of mappings or a mapping name -> settings"
        )
    for k, entry in enumerate(entries):
        if not isinstance(entry, dict) or not entry.get("name") or not entry.get("path"):
            raise ValueError(f"{where}: datasets[{k}] needs a `name` and a `path`")
    for where_key, mapping in [("defaults", defaults)] + [(f"dataset {e['name']!r}", e) for e in entries]:
        _check_keys(mapping, f"{where}, {where_key}", allow_identity=where_key != "defaults")
    return defaults, entries


def _check_keys(mapping: dict[str, Any], where: str, allow_identity: bool) -> None:
    known = (
        set(DATA_KEYS)
        | set(SAMPLING_KEYS)
        | set(PLUGIN_KEYS)
        | ({"name", "path"} if allow_identity else set())
    )
    for key in mapping:
        if key in NOT_HERE:
            raise ValueError(f"{where}: `{key}` is slime's, for a feature not built here; drop it")
        if key not in known:
            raise ValueError(f"{where}: unknown key `{key}`; known: {', '.join(sorted(known))}")


def name_path_pairs(values: list[str]) -> list[tuple[str | None, str]]:
    """--eval-prompt-data's values: one PATH (an unnamed set), or NAME PATH pairs."""
    if len(values) == 1:
        return [(None, values[0])]
    return list(zip(values[::2], values[1::2], strict=False))  # an odd count is refused by eval_datasets


def eval_datasets(ns: argparse.Namespace) -> tuple[EvalDataset, ...]:
    """The evaluation sets the flags describe (ValueError names the flag and the fix)."""
    if ns.eval_config is not None:
        defaults, entries = _read_config(ns.eval_config)
    elif ns.eval_prompt_data:
        values = list(ns.eval_prompt_data)
        if len(values) > 1 and len(values) % 2:
            raise ValueError(
                f"--eval-prompt-data takes one PATH or NAME PATH pairs; got {len(values)} values: "
                f"{' '.join(values)}"
            )
        defaults, entries = {}, [{"name": n, "path": p} for n, p in name_path_pairs(values)]
    else:
        return ()
    names = [e["name"] for e in entries]
    if len(set(names)) != len(names):
        raise ValueError(f"the evaluation sets repeat a name: {', '.join(str(n) for n in names)}")
    datasets = tuple(_dataset(ns, defaults, e) for e in entries)
    for ds in datasets:
        if needs_reward_key(ds.rm_type) and ns.reward_key is None:
            raise ValueError(
                f"evaluation set {ds.name or ds.data.prompt_data}: rm_type {ds.rm_type} returns a dict "
                "{score, acc, pred}: add --reward-key score"
            )
    return datasets


def _dataset(ns: argparse.Namespace, defaults: dict[str, Any], entry: dict[str, Any]) -> EvalDataset:
    def pick(key: str, attrs: tuple[str, ...]) -> Any:
        if key in entry:
            return entry[key]
        if key in defaults:
            return defaults[key]
        return _cli(ns, attrs)

    data = DataConfig(
        prompt_data=str(entry["path"]),
        **{k: pick(k, attrs) for k, attrs in DATA_KEYS.items()},
        max_prompt_len=ns.eval_max_prompt_len,
        shuffle=False,
        seed=ns.rollout_seed,
    )
    values = {k: pick(k, attrs) for k, attrs in SAMPLING_KEYS.items()}
    sampling = SamplingConfig(
        n_samples_per_prompt=int(values["n_samples_per_eval_prompt"]),
        temperature=float(values["temperature"]),
        top_p=float(values["top_p"]),
        top_k=int(values["top_k"]),
        max_response_len=int(values["max_response_len"]),
        stop=tuple(values["stop"] or ()),
        stop_token_ids=tuple(values["stop_token_ids"] or ()),
        min_new_tokens=None if values["min_new_tokens"] is None else int(values["min_new_tokens"]),
    )
    name = entry.get("name")
    refused = sampling.refused()
    if refused is not None:
        where = "--eval-prompt-data" if name is None else f"evaluation set {name!r}"
        raise ValueError(f"{where}: its {refused.field} {refused.reason}: the engines refuse such a request")
    return EvalDataset(
        None if name is None else str(name), data, sampling, *(pick(k, ()) for k in PLUGIN_KEYS)
    )


def eval_flag(ds: EvalDataset) -> str:
    """How a set's file is named in messages."""
    return "--eval-prompt-data" if ds.name is None else f"evaluation set {ds.name!r}"


def describe(sets: tuple[EvalDataset, ...]) -> str:
    return "; ".join(
        f"{s.name or 'eval'}: {s.data.prompt_data} ({s.sampling.n_samples_per_prompt} per prompt, "
        f"temperature {s.sampling.temperature:g})"
        for s in sets
    )
