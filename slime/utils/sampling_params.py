"""How one response is sampled: SGLang's `sampling_params`, the one record of it.

The rollout's flags (slime.config.rollout.SamplingConfig) are checked with these rules when
they are parsed, and the engines (slime.engines.protocol) read every request's with them, so a
value the engine would refuse is refused before a job starts. A wrong field raises
`FieldError` naming it; the engine answers it as HTTP 400, the command line as the flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

SEED_LIMIT = 2**64
"""torch.Generator.manual_seed takes an unsigned 64-bit seed."""


class FieldError(ValueError):
    """A request field of the wrong type or out of range. `field`: its name as sent
    (`sampling_params.top_p`); `reason`: what is wrong, with the accepted values."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"'{field}' {reason}")
        self.field = field
        self.reason = reason


def expect(cond: bool, field: str, reason: str) -> None:
    if not cond:
        raise FieldError(field, reason)


def as_int(value: Any, field: str) -> int:
    expect(
        isinstance(value, int) and not isinstance(value, bool), field, f"must be an integer, got {value!r}"
    )
    return int(value)


def as_float(value: Any, field: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    expect(ok, field, f"must be a number, got {value!r}")
    expect(math.isfinite(float(value)), field, f"must be finite, got {value!r}")
    return float(value)


def as_str_list(value: Any, field: str) -> list[str]:
    """A string or a list of strings (OpenAI's and SGLang's `stop`); empty strings dropped."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value] if value else []
    expect(
        isinstance(value, list) and all(isinstance(v, str) for v in value),
        field,
        "must be a string or a list of strings",
    )
    return [v for v in value if v]


_IGNORED = frozenset(
    (
        "n",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "spaces_between_special_tokens",
        "regex",
        "json_schema",
        "ebnf",
        "custom_params",
        "stream_interval",
        "logit_bias",
        "seed",
    )
)
"""SGLang's fields the torch engine accepts and does not apply."""


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
        """The record of a request's `sampling_params` object; FieldError names a wrong field."""
        if raw is None:
            raw = {}
        expect(isinstance(raw, dict), "sampling_params", "must be a JSON object")
        known = set(cls.__dataclass_fields__)
        raw = dict(raw)
        if "seed" in raw and "sampling_seed" not in raw:  # OpenAI-style clients send `seed`
            raw["sampling_seed"] = raw.pop("seed")
        if raw.pop("min_new_tokens", None) not in (None, 0):  # SGLang's masks the stop tokens until then
            expect(
                False,
                "sampling_params.min_new_tokens",
                "is not applied by the torch engine: use SGLang engines",
            )
        unknown = sorted(set(raw) - known - _IGNORED)
        expect(not unknown, "sampling_params", f"has unknown field(s) {unknown}; supported: {sorted(known)}")
        kw: dict[str, Any] = {}

        def number(name: str, kind: Any, ok: Any, accepted: str) -> None:
            if raw.get(name) is not None:
                field = f"sampling_params.{name}"
                value = kind(raw[name], field)
                expect(ok(value), field, f"must be {accepted}, got {value}")
                kw[name] = value

        number("max_new_tokens", as_int, lambda v: v >= 0, ">= 0")
        number("temperature", as_float, lambda v: v >= 0, ">= 0")
        number("top_p", as_float, lambda v: 0 < v <= 1, "in (0, 1]")
        number("top_k", as_int, lambda v: v == -1 or v >= 1, "-1 (disabled) or >= 1")
        number("min_p", as_float, lambda v: 0 <= v <= 1, "in [0, 1]")
        number("sampling_seed", as_int, lambda v: 0 <= v < SEED_LIMIT, "in [0, 2**64)")
        kw["stop"] = tuple(as_str_list(raw.get("stop"), "sampling_params.stop"))
        if raw.get("stop_token_ids") is not None:
            ids = raw["stop_token_ids"]
            expect(isinstance(ids, list), "sampling_params.stop_token_ids", "must be a list of integers")
            kw["stop_token_ids"] = tuple(as_int(i, "sampling_params.stop_token_ids[]") for i in ids)
        for name in ("ignore_eos", "skip_special_tokens", "no_stop_trim"):
            if raw.get(name) is not None:
                expect(isinstance(raw[name], bool), f"sampling_params.{name}", "must be true or false")
                kw[name] = raw[name]
        return cls(**kw)
