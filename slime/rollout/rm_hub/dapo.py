"""The `dapo` reward: the last "Answer: ..." line against an integer label (Minerva-style).

Returns a dict, as slime's does: `score` (1.0 right, -1.0 wrong), `acc` (bool) and `pred` (the
normalised prediction, "[INVALID]" when there is no answer line). Train on it with
`--reward-key score`. Only the last 300 characters of the response are read. The label must be
an integer (DAPO's answers all are): a label that is not raises ValueError.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

NUM_TAIL_CHARS = 300
NO_ANSWER = "[INVALID]"
_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)

# The three tables below are the final-answer normalisation that the Minerva paper (Lewkowycz
# et al., 2022) defined for Hendrycks et al.'s MATH answers, as in EleutherAI's
# lm-evaluation-harness (Apache-2.0), DAPO's verifier and slime's rm_hub (math_dapo_utils.py).
# They are reproduced as data, entry for entry and in order, so that our scores agree.

# Literal rewrites, in order: spacing, articles and LaTeX spellings of the same thing.
_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
# Units, filler words, LaTeX decorations and chat end tokens deleted, in order (the
# `\text{}^2` entries must go before the bare `\text{}`).
_REMOVED_EXPRESSIONS: tuple[str, ...] = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
    "<|im_end|>",
    "<|endoftext|>",
)
# Regex rewrites, in order: keep the first $...$, unwrap \text{}, \textbf{}, \overline{} and
# \boxed{}, then brace the shorthand \fracab and \sqrta.
_REGEX_REWRITES: tuple[tuple[str, str], ...] = (
    (r"(.*?)\$(.*?)\$(.*)", r"$\2$"),
    (r"\\text\{(.*?)\}", r"\1"),
    (r"\\textbf\{(.*?)\}", r"\1"),
    (r"\\overline\{(.*?)\}", r"\1"),
    (r"\\boxed\{(.*)\}", r"\1"),
    (r"frac([^{])(.)", r"frac{\1}{\2}"),
    (r"sqrt([^{])", r"sqrt{\1}"),
)


def _replacing(old: str, new: str) -> Callable[[str], str]:
    return lambda text: text.replace(old, new)


def _substituting(pattern: str, replacement: str) -> Callable[[str], str]:
    compiled = re.compile(pattern)
    return lambda text: compiled.sub(replacement, text)


def _right_of_last_equals(text: str) -> str:
    return text.rpartition("=")[2]


def _without_digit_grouping(text: str) -> str:
    """Thousands commas out of a plain integer ("1,000" -> "1000"); other commas ("1,2") kept."""
    ungrouped = text.replace(",", "")
    return ungrouped if ungrouped.isdigit() else text


# The normalisation as one list of text -> text steps, applied in order.
_STEPS: tuple[Callable[[str], str], ...] = (
    _right_of_last_equals,
    *(_replacing(old, new) for old, new in _SUBSTITUTIONS),
    *(_replacing(expr, "") for expr in _REMOVED_EXPRESSIONS),
    *(_substituting(pattern, repl) for pattern, repl in _REGEX_REWRITES),
    _replacing("$", ""),
    _without_digit_grouping,
    str.strip,
)


def normalize_final_answer(answer: Any) -> str:
    """The answer in a canonical spelling (right side of the last "=", units and LaTeX removed)."""
    return functools.reduce(lambda text, step: step(text), _STEPS, str(answer))


def dapo_reward(response: str, label: Any) -> dict[str, Any]:
    """{"score": 1.0 | -1.0, "acc": bool, "pred": str} for the last "Answer:" line of `response`."""
    answer_lines = _ANSWER_LINE.findall(response[-NUM_TAIL_CHARS:])
    pred = normalize_final_answer((answer_lines or [NO_ANSWER])[-1])
    # The label is compared as an integer: "3.0" and "3" are the same label, "1/2" is an error.
    truth = str(int(float(normalize_final_answer(label))))
    return {"score": 1.0 if pred == truth else -1.0, "acc": pred == truth, "pred": pred}
