"""Reward functions: built-in verifiers (`--rm-type`) and user functions (`--custom-rm-path`).

A user function has slime's signature: `f(args, sample) -> float | dict` (sync or async), or
with `--group-rm`, `f(args, samples) -> list` (one reward per sample of a prompt group). `args`
is the parsed command line (an argparse.Namespace), as in slime. A reward function that raises
ends the job: the error propagates with its traceback.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

from slime.rollout.sample import Sample
from slime.utils.errors import UsageError

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")


def load_function(dotted: str, flag: str) -> Callable[..., Any]:
    """Import `package.module.function`; a clear error names the flag when it cannot."""
    module_name, _, attr = dotted.rpartition(".")
    if not module_name:
        raise UsageError(f"{flag} {dotted!r} must be a dotted path: package.module.function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"{flag} {dotted!r}: cannot import module {module_name!r} ({e})") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UsageError(f"{flag} {dotted!r}: module {module_name!r} has no function {attr!r}")
    return fn


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _to_number(text: str) -> float | None:
    text = text.strip().replace(",", "").rstrip(".")
    try:
        if "/" in text:
            num, den = text.split("/", 1)
            return float(num) / float(den)
        return float(text)
    except (ValueError, ZeroDivisionError):
        return None


def math_reward(response: str, label: Any) -> float:
    """1.0 when the answer (last \\boxed{}, else the last number) equals the label numerically."""
    answer = extract_boxed(response)
    if answer is None:
        numbers = _NUMBER.findall(response)
        answer = numbers[-1] if numbers else None
    if answer is None:
        return 0.0
    got, want = _to_number(answer), _to_number(str(label))
    if got is None or want is None:
        return float(answer.strip() == str(label).strip())
    return float(abs(got - want) <= 1e-6 * max(1.0, abs(want)))


def exact_reward(response: str, label: Any) -> float:
    """1.0 when the stripped response equals the stripped label (the demo's arithmetic task)."""
    return float(response.strip() == str(label).strip())


BUILTIN = {"math": math_reward, "exact": exact_reward}


class RewardModel:
    """Scores samples with a built-in verifier or a user function."""

    def __init__(self, rm_type: str | None, custom_rm_path: str | None, group_rm: bool, args: Any):
        self.args = args
        self.group = group_rm
        if custom_rm_path:
            self.fn = load_function(custom_rm_path, "--custom-rm-path")
            self.builtin = None
        elif rm_type in BUILTIN:
            if group_rm:
                raise ValueError(
                    "--group-rm needs --custom-rm-path (built-in --rm-type rewards score one sample)"
                )
            self.builtin = BUILTIN[rm_type]
        else:
            raise ValueError(
                f"--rm-type {rm_type!r} is not one of {', '.join(BUILTIN)}; or give --custom-rm-path"
            )

    async def score_group(self, samples: list[Sample]) -> None:
        """Set `reward` on every sample of one prompt group."""
        if self.builtin is not None:
            for s in samples:
                s.reward = self.builtin(s.response, s.label)
            return
        if self.group:
            rewards = await _call(self.fn, self.args, samples)
            if not isinstance(rewards, list | tuple) or len(rewards) != len(samples):
                raise ValueError(
                    f"--custom-rm-path with --group-rm must return one reward per sample "
                    f"({len(samples)}), got {type(rewards).__name__}"
                )
            for s, r in zip(samples, rewards):
                s.reward = r
            return
        results = await asyncio.gather(*(_call(self.fn, self.args, s) for s in samples))
        for s, r in zip(samples, results):
            s.reward = r


async def _call(fn: Callable[..., Any], *args: Any) -> Any:
    result = fn(*args)
    if inspect.isawaitable(result):
        result = await result
    return result
