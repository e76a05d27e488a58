"""Request models for the SGLang HTTP protocol subset that slime's engines speak.

These are our own parsers (sglang's request types cannot be imported on a CPU machine). Field
names follow SGLang's `GenerateReqInput` / `SamplingParams` so the same JSON drives a real SGLang
server and the built-in torch engine. Every validation failure raises `ProtocolError` whose
message names the offending field and the accepted values.
"""

from __future__ import annotations

import math
import secrets
import uuid
from dataclasses import dataclass, field
from typing import Any


class ProtocolError(Exception):
    """A request the server refuses; `status` is the HTTP code (4xx for client mistakes)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


API_KEY_ENV = "SLIME_ENGINE_API_KEY"
"""The environment variable a torch engine reads its API key from: unlike a command-line flag
(/proc/<pid>/cmdline is world-readable), a process's environment is readable only by its user."""


def new_api_key() -> str:
    """A fresh random key for the engines of one job (256 bits as 64 hex digits). Not
    token_urlsafe: one key in 32 would start with "-", which SGLang's argument parser (the
    key reaches it through a --config file turned into arguments) takes for a flag."""
    return secrets.token_hex(32)


def check_api_key(key: str) -> None:
    """Raise ValueError unless `key` can travel in an `Authorization: Bearer` header (visible
    ASCII, no spaces). The message never contains the key: it may end up in a log."""
    if not key or not all("!" <= c <= "~" for c in key):
        raise ValueError(
            f"the API key must be a non-empty string of visible ASCII characters without spaces "
            f"(the given one has {len(key)} characters; it is not shown)"
        )


def _expect(cond: bool, message: str, status: int = 400) -> None:
    if not cond:
        raise ProtocolError(message, status)


def _as_int(value: Any, name: str) -> int:
    _expect(
        isinstance(value, int) and not isinstance(value, bool), f"'{name}' must be an integer, got {value!r}"
    )
    return int(value)


def _as_float(value: Any, name: str) -> float:
    _expect(
        isinstance(value, (int, float)) and not isinstance(value, bool),
        f"'{name}' must be a number, got {value!r}",
    )
    _expect(math.isfinite(float(value)), f"'{name}' must be finite, got {value!r}")
    return float(value)


def _is_token_ids(value: Any) -> bool:
    """A non-empty list of integer token ids (JSON true/false are not token ids)."""
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


# torch.Generator.manual_seed takes an unsigned 64-bit seed.
SEED_LIMIT = 2**64


def _as_str_list(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    _expect(
        isinstance(value, list) and all(isinstance(v, str) for v in value),
        f"'{name}' must be a string or a list of strings",
    )
    return [v for v in value if v]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings, with SGLang's names and defaults.

    The reported log-prob of a sampled token is log softmax(logits / temperature) at that token,
    computed before top-k / top-p / min-p truncation (for temperature 0: plain log softmax).
    This is the quantity the trainer recomputes at the rollout temperature.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def needs_truncation(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 1 or self.min_p > 0.0

    @classmethod
    def from_json(cls, raw: Any) -> SamplingParams:
        if raw is None:
            raw = {}
        _expect(isinstance(raw, dict), "'sampling_params' must be a JSON object")
        known = {f for f in cls.__dataclass_fields__}
        # `seed` is accepted as an alias: OpenAI-style clients send it.
        raw = dict(raw)
        if "seed" in raw and "sampling_seed" not in raw:
            raw["sampling_seed"] = raw.pop("seed")
        ignored = {
            "n",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
            "min_new_tokens",
            "spaces_between_special_tokens",
            "regex",
            "json_schema",
            "ebnf",
            "custom_params",
            "stream_interval",
            "logit_bias",
            "seed",
        }
        unknown = sorted(set(raw) - known - ignored)
        _expect(not unknown, f"unknown sampling_params field(s) {unknown}; supported: {sorted(known)}")
        kw: dict[str, Any] = {}
        if raw.get("max_new_tokens") is not None:
            kw["max_new_tokens"] = _as_int(raw["max_new_tokens"], "sampling_params.max_new_tokens")
            _expect(
                kw["max_new_tokens"] >= 0,
                f"'sampling_params.max_new_tokens' must be >= 0, got {kw['max_new_tokens']}",
            )
        if raw.get("temperature") is not None:
            kw["temperature"] = _as_float(raw["temperature"], "sampling_params.temperature")
            _expect(
                kw["temperature"] >= 0, f"'sampling_params.temperature' must be >= 0, got {kw['temperature']}"
            )
        if raw.get("top_p") is not None:
            kw["top_p"] = _as_float(raw["top_p"], "sampling_params.top_p")
            _expect(0 < kw["top_p"] <= 1, f"'sampling_params.top_p' must be in (0, 1], got {kw['top_p']}")
        if raw.get("top_k") is not None:
            kw["top_k"] = _as_int(raw["top_k"], "sampling_params.top_k")
            _expect(
                kw["top_k"] == -1 or kw["top_k"] >= 1,
                f"'sampling_params.top_k' must be -1 (disabled) or >= 1, got {kw['top_k']}",
            )
        if raw.get("min_p") is not None:
            kw["min_p"] = _as_float(raw["min_p"], "sampling_params.min_p")
            _expect(0 <= kw["min_p"] <= 1, f"'sampling_params.min_p' must be in [0, 1], got {kw['min_p']}")
        kw["stop"] = tuple(_as_str_list(raw.get("stop"), "sampling_params.stop"))
        if raw.get("stop_token_ids") is not None:
            ids = raw["stop_token_ids"]
            _expect(isinstance(ids, list), "'sampling_params.stop_token_ids' must be a list of integers")
            kw["stop_token_ids"] = tuple(_as_int(i, "sampling_params.stop_token_ids[]") for i in ids)
        for flag in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if raw.get(flag) is not None:
                _expect(isinstance(raw[flag], bool), f"'sampling_params.{flag}' must be true or false")
                kw[flag] = raw[flag]
        if raw.get("sampling_seed") is not None:
            seed = _as_int(raw["sampling_seed"], "sampling_params.sampling_seed")
            _expect(
                0 <= seed < SEED_LIMIT,
                f"'sampling_params.sampling_seed' must be in [0, 2**64), got {seed}",
            )
            kw["sampling_seed"] = seed
        return cls(**kw)


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt of a /generate call (a batch call is split into several)."""

    rid: str
    input_ids: tuple[int, ...] | None
    text: str | None
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    return_routed_experts: bool = False
    """SGLang's field: report the experts each token was routed to (meta_info "routed_experts")."""
    logprob_start_len: int = -1
    """SGLang's field: with `return_logprob`, also report the log-prob of every input token from
    this position on (meta_info "input_token_logprobs"; -1: output tokens only)."""
    return_text_in_logprobs: bool = False
    """SGLang's field: each log-prob entry carries its token's text (else null)."""
    lora_path: str | None = None
    """SGLang's field: the name of the loaded LoRA adapter this prompt runs with (None: the base model)."""


def parse_generate(body: Any) -> tuple[list[GenerateRequest], bool]:
    """Parse a /generate body into single-prompt requests.

    Returns:
        (requests, is_batch): `is_batch` tells the server to answer with a JSON list.
    """
    _expect(isinstance(body, dict), "request body must be a JSON object")
    _expect(not body.get("stream"), "'stream': true is not supported by this engine; omit it")
    for unsupported in ("image_data", "audio_data", "video_data", "input_embeds"):
        _expect(body.get(unsupported) is None, f"'{unsupported}' is not supported by this engine")
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    _expect(has_ids != has_text, "give exactly one of 'input_ids' or 'text'")
    prompts: list[Any] = []
    if has_ids:
        ids = body["input_ids"]
        _expect(isinstance(ids, list) and len(ids) > 0, "'input_ids' must be a non-empty list of token ids")
        is_batch = isinstance(ids[0], list)
        prompts = ids if is_batch else [ids]
        for p in prompts:
            _expect(
                _is_token_ids(p),
                "'input_ids' must be a non-empty list of integer token ids (or a list of such lists)",
            )
    else:
        text = body["text"]
        is_batch = isinstance(text, list)
        prompts = text if is_batch else [text]
        _expect(all(isinstance(t, str) for t in prompts), "'text' must be a string or a list of strings")
    n = len(prompts)
    _expect(n > 0, "empty batch")
    sampling = _per_prompt(body.get("sampling_params"), n, "sampling_params")
    rids = _per_prompt(body.get("rid"), n, "rid")
    return_logprob = _per_prompt(body.get("return_logprob", False), n, "return_logprob")
    top_n = _per_prompt(body.get("top_logprobs_num", 0), n, "top_logprobs_num")
    routed = _per_prompt(body.get("return_routed_experts", False), n, "return_routed_experts")
    starts = _per_prompt(body.get("logprob_start_len", -1), n, "logprob_start_len")
    loras = _per_prompt(body.get("lora_path"), n, "lora_path")
    with_text = body.get("return_text_in_logprobs", False)
    _expect(isinstance(with_text, bool), "'return_text_in_logprobs' must be true or false")
    requests = []
    for i, prompt in enumerate(prompts):
        rid = rids[i] if rids[i] is not None else uuid.uuid4().hex
        _expect(isinstance(rid, str) and rid != "", "'rid' must be a non-empty string")
        _expect(isinstance(return_logprob[i], bool), "'return_logprob' must be true or false")
        _expect(isinstance(routed[i], bool), "'return_routed_experts' must be true or false")
        top = _as_int(top_n[i] or 0, "top_logprobs_num")
        _expect(top >= 0, f"'top_logprobs_num' must be >= 0, got {top}")
        start = _as_int(-1 if starts[i] is None else starts[i], "logprob_start_len")
        _expect(start >= -1, f"'logprob_start_len' must be >= -1, got {start}")
        _expect(loras[i] is None or (isinstance(loras[i], str) and loras[i] != ""),
                "'lora_path' must name a loaded LoRA adapter (a string, or a list with one per prompt; null: none)")  # fmt: skip
        requests.append(
            GenerateRequest(
                rid=rid,
                input_ids=tuple(prompt) if has_ids else None,
                text=prompt if not has_ids else None,
                sampling_params=SamplingParams.from_json(sampling[i]),
                return_logprob=return_logprob[i],
                top_logprobs_num=top,
                return_routed_experts=routed[i],
                logprob_start_len=start,
                return_text_in_logprobs=with_text,
                lora_path=loras[i],
            )
        )
    _expect(len({r.rid for r in requests}) == n, "'rid' values in one batch must be distinct")
    return requests, is_batch


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    """SGLang lets batch fields be one value for all prompts or a list with one per prompt."""
    if isinstance(value, list):
        _expect(len(value) == n, f"'{name}' has {len(value)} entries for {n} prompts")
        return list(value)
    if n > 1 and name == "rid" and value is not None:
        raise ProtocolError("'rid' must be a list with one id per prompt in a batch request")
    return [value] * n


@dataclass
class FinishReason:
    """SGLang's finish_reason object: {"type": "stop"|"length"|"abort", ...}."""

    type: str
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        elif self.type == "abort":
            out["message"] = self.message or "aborted"
        return out


@dataclass(frozen=True)
class NamedTensorSpec:
    """Name, dtype string and shape of one tensor in a weight update request."""

    name: str
    dtype: str
    shape: tuple[int, ...]


def parse_tensor_specs(body: dict[str, Any]) -> list[NamedTensorSpec]:
    """Parse the parallel `names` / `dtypes` / `shapes` lists of update_weights_from_distributed."""
    names: Any = body.get("names")
    dtypes: Any = body.get("dtypes")
    shapes: Any = body.get("shapes")
    _expect(
        isinstance(names, list) and len(names) > 0 and all(isinstance(n, str) for n in names),
        "'names' must be a non-empty list of parameter names",
    )
    _expect(
        isinstance(dtypes, list) and len(dtypes) == len(names),
        f"'dtypes' must be a list with one entry per name ({len(names)})",
    )
    _expect(
        isinstance(shapes, list) and len(shapes) == len(names),
        f"'shapes' must be a list with one entry per name ({len(names)})",
    )
    specs = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        _expect(isinstance(dtype, str), f"dtype of '{name}' must be a string like 'bfloat16'")
        _expect(
            isinstance(shape, list) and all(isinstance(s, int) and s >= 0 for s in shape),
            f"shape of '{name}' must be a list of non-negative integers",
        )
        specs.append(NamedTensorSpec(name, dtype.removeprefix("torch."), tuple(shape)))
    return specs


@dataclass
class CompletionRequest:
    """The OpenAI /v1/completions subset: prompt, max_tokens, temperature, top_p, n, logprobs, stop, seed."""

    prompts: list[str | list[int]] = field(default_factory=list)
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    logprobs: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    model: str | None = None

    @classmethod
    def from_json(cls, body: Any) -> CompletionRequest:
        _expect(isinstance(body, dict), "request body must be a JSON object")
        _expect(not body.get("stream"), "'stream': true is not supported by this engine; omit it")
        prompt = body.get("prompt")
        _expect(prompt is not None, "'prompt' is required")
        prompts = _completion_prompts(prompt)
        req = cls(prompts=prompts, model=body.get("model"))
        if body.get("max_tokens") is not None:
            req.max_tokens = _as_int(body["max_tokens"], "max_tokens")
            _expect(req.max_tokens >= 0, f"'max_tokens' must be >= 0, got {req.max_tokens}")
        if body.get("temperature") is not None:
            req.temperature = _as_float(body["temperature"], "temperature")
            _expect(req.temperature >= 0, f"'temperature' must be >= 0, got {req.temperature}")
        if body.get("top_p") is not None:
            req.top_p = _as_float(body["top_p"], "top_p")
            _expect(0 < req.top_p <= 1, f"'top_p' must be in (0, 1], got {req.top_p}")
        if body.get("n") is not None:
            req.n = _as_int(body["n"], "n")
            _expect(1 <= req.n <= 128, f"'n' must be between 1 and 128, got {req.n}")
        if body.get("logprobs") is not None:
            req.logprobs = _as_int(body["logprobs"], "logprobs")
            _expect(0 <= req.logprobs <= 20, f"'logprobs' must be between 0 and 20, got {req.logprobs}")
        req.stop = tuple(_as_str_list(body.get("stop"), "stop"))
        if body.get("seed") is not None:
            req.seed = _as_int(body["seed"], "seed")
            # Choice c of n samples with seed + c, which must stay a valid seed too.
            _expect(
                0 <= req.seed <= SEED_LIMIT - req.n,
                f"'seed' must be in [0, 2**64 - n] (n = {req.n}), got {req.seed}",
            )
        return req


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    """OpenAI's prompt forms: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if _is_token_ids(prompt):
        return [list(prompt)]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        for i, p in enumerate(prompt):
            _expect(
                _is_token_ids(p),
                f"'prompt[{i}]' must be a non-empty list of integer token ids, got {str(p)[:40]}",
            )
        return list(prompt)
    raise ProtocolError(
        "'prompt' must be a string, a list of strings, a non-empty list of token ids, or a list of such lists"
    )
