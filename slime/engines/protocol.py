"""Request models for the SGLang HTTP protocol subset that slime's engines speak.

These are our own parsers (sglang's request types cannot be imported on a CPU machine). Field
names follow SGLang's `GenerateReqInput` / `SamplingParams` so the same JSON drives a real SGLang
server and the built-in torch engine. Every validation failure raises `ProtocolError` whose
message names the offending field and the accepted values. A request's `sampling_params` is
slime.utils.sampling_params.SamplingParams, whose checks the rollout's flags share.
"""

from __future__ import annotations

import functools
import secrets
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from slime.utils.sampling_params import SEED_LIMIT, FieldError, SamplingParams, as_float, as_int, as_str_list


class ProtocolError(Exception):
    """A request the server refuses; `status` is the HTTP code (4xx for client mistakes)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.message = message
        self.status = status


PROFILE_DIR_ENV = "SGLANG_TORCH_PROFILER_DIR"
"""SGLang's variable for where its profiles go; the torch engine's /start_profile writes only
under the directory it names (slime.engines.torch_engine.profile_api)."""

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


F = TypeVar("F", bound=Callable[..., Any])


def _refusing(parse: F) -> F:
    """`parse` with a wrong field (FieldError, from the field checks it shares with the flags'
    sampling settings) answered as a ProtocolError (400)."""

    @functools.wraps(parse)
    def checked(*args: Any, **kwargs: Any) -> Any:
        try:
            return parse(*args, **kwargs)
        except FieldError as e:
            raise ProtocolError(str(e)) from None

    return checked  # type: ignore[return-value]


def _is_token_ids(value: Any) -> bool:
    """A non-empty list of integer token ids (JSON true/false are not token ids)."""
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    )


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
    image_data: tuple[str, ...] = ()
    """SGLang's field: this prompt's images, in the order of its image placeholders (paths, data
    URLs, base64 or URLs); vision-language models only."""


@_refusing
def parse_generate(body: Any) -> tuple[list[GenerateRequest], bool]:
    """Parse a /generate body into single-prompt requests.

    Returns:
        (requests, is_batch): `is_batch` tells the server to answer with a JSON list.
    """
    _expect(isinstance(body, dict), "request body must be a JSON object")
    _expect(not body.get("stream"), "'stream': true is not supported by this engine; omit it")
    for unsupported in ("audio_data", "video_data", "input_embeds"):
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
    images = _images_per_prompt(body.get("image_data"), n, is_batch)
    with_text = body.get("return_text_in_logprobs", False)
    _expect(isinstance(with_text, bool), "'return_text_in_logprobs' must be true or false")
    requests = []
    for i, prompt in enumerate(prompts):
        rid = rids[i] if rids[i] is not None else uuid.uuid4().hex
        _expect(isinstance(rid, str) and rid != "", "'rid' must be a non-empty string")
        _expect(isinstance(return_logprob[i], bool), "'return_logprob' must be true or false")
        _expect(isinstance(routed[i], bool), "'return_routed_experts' must be true or false")
        top = as_int(top_n[i] or 0, "top_logprobs_num")
        _expect(top >= 0, f"'top_logprobs_num' must be >= 0, got {top}")
        start = as_int(-1 if starts[i] is None else starts[i], "logprob_start_len")
        _expect(start >= -1, f"'logprob_start_len' must be >= -1, got {start}")
        _expect(
            loras[i] is None or (isinstance(loras[i], str) and loras[i] != ""),
            "'lora_path' must name a loaded LoRA adapter (a string, or a list with one per prompt; null: "
            "none)",
        )
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
                image_data=images[i],
            )
        )
    _expect(len({r.rid for r in requests}) == n, "'rid' values in one batch must be distinct")
    return requests, is_batch


def _images_per_prompt(value: Any, n: int, is_batch: bool) -> list[tuple[str, ...]]:
    """SGLang's `image_data`: one image (a string) or a list of them for a single prompt; for a
    batch, one entry (a string, a list, or null) per prompt."""
    if value is None:
        return [()] * n
    what = "'image_data' must be an image (a path, data URL, base64 text or URL) or a list of them"
    if not is_batch:
        value = [value]
    _expect(isinstance(value, list) and len(value) == n, f"{what}, one entry per prompt of the batch")
    out = []
    for entry in value:
        entry = [] if entry is None else [entry] if isinstance(entry, str) else entry
        _expect(isinstance(entry, list) and all(isinstance(x, str) and x for x in entry), what)
        out.append(tuple(entry))
    return out


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
    @_refusing
    def from_json(cls, body: Any) -> CompletionRequest:
        _expect(isinstance(body, dict), "request body must be a JSON object")
        _expect(not body.get("stream"), "'stream': true is not supported by this engine; omit it")
        prompt = body.get("prompt")
        _expect(prompt is not None, "'prompt' is required")
        prompts = _completion_prompts(prompt)
        req = cls(prompts=prompts, model=body.get("model"))
        if body.get("max_tokens") is not None:
            req.max_tokens = as_int(body["max_tokens"], "max_tokens")
            _expect(req.max_tokens >= 0, f"'max_tokens' must be >= 0, got {req.max_tokens}")
        if body.get("temperature") is not None:
            req.temperature = as_float(body["temperature"], "temperature")
            _expect(req.temperature >= 0, f"'temperature' must be >= 0, got {req.temperature}")
        if body.get("top_p") is not None:
            req.top_p = as_float(body["top_p"], "top_p")
            _expect(0 < req.top_p <= 1, f"'top_p' must be in (0, 1], got {req.top_p}")
        if body.get("n") is not None:
            req.n = as_int(body["n"], "n")
            _expect(1 <= req.n <= 128, f"'n' must be between 1 and 128, got {req.n}")
        if body.get("logprobs") is not None:
            req.logprobs = as_int(body["logprobs"], "logprobs")
            _expect(0 <= req.logprobs <= 20, f"'logprobs' must be between 0 and 20, got {req.logprobs}")
        req.stop = tuple(as_str_list(body.get("stop"), "stop"))
        if body.get("seed") is not None:
            req.seed = as_int(body["seed"], "seed")
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
