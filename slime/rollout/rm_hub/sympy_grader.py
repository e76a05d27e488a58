"""Symbolic equality of two math answers (sympy, with LaTeX read by pylatexenc).

Both answers are normalised (units, `$`, `%`, thousands commas, LaTeX to plain text), then
compared as strings, element by element for tuples and intervals, and finally by asking sympy
whether their difference simplifies to zero. The rules are those of the grader slime's `math` and
`deepscaler` rewards use (PRM800K's, built on Hendrycks' MATH normalisation), so scores agree.
Integers and unreduced fractions are compared strictly: `2/4` does not equal `1/2`.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from slime.rollout.rm_hub.deps import require

# The tables below (units, scale words, characters, sympy guards) come from the answer grader
# OpenAI released with PRM800K (grading/grader.py), which extends Hendrycks et al.'s MATH answer
# normalisation and which DeepScaleR and slime's rm_hub (math_utils.py) use. They are reproduced
# as data, entry for entry and in order, so that our scores agree.

_WRAPPED_IN_TEXT = re.compile(r"^\\text\{(?P<inner>.+?)\}$")
# Literal edits, in order: currency and percent signs, "or"/"and" lists, scale words.
_LITERAL_EDITS: tuple[tuple[str, str], ...] = (
    ("\\%", "%"),
    ("\\$", "$"),
    ("$", ""),
    ("%", ""),
    (" or ", " , "),
    (" and ", " , "),
    ("million", "*10^6"),
    ("billion", "*10^9"),
    ("trillion", "*10^12"),
)
# Unit words deleted one after the other (plural, a space and a power with them).
_UNITS = (
    "degree",
    "cm",
    "centimeter",
    "meter",
    "mile",
    "second",
    "minute",
    "hour",
    "day",
    "week",
    "month",
    "year",
    "foot",
    "feet",
    "inch",
    "yard",
)
_UNIT_PATTERNS = tuple(re.compile(unit + r"(es)?(s)? *(\^[0-9]+)?") for unit in _UNITS)
_DEGREE_SIGN = re.compile(r"\^ *\\circ")
_THIN_SPACE_COMMA = re.compile(r",\\! *")
_MINUS_SPACES = re.compile(r"- *")
# Deleted once the LaTeX is plain text: spaces and leftover braces.
_DELETED_LAST = ((" ", ""), ("{", ""), ("}", ""))
# Characters pylatexenc writes for LaTeX symbols, spelled the way sympy reads them.
_UNICODE_TO_SYMPY = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))
# Fraction spellings pylatexenc should see; the space keeps a mixed number "7\frac34" two terms.
_FRAC_SPELLINGS = (("\\tfrac", "\\frac"), ("\\dfrac", "\\frac"), ("\\frac", " \\frac"))
# A thousands separator: a comma between a digit and exactly three digits.
_THOUSANDS_COMMA = re.compile(r"(\d),(\d\d\d)($|\D)")
_MIXED_NUMBER = re.compile(r"([0-9]) +([0-9])")
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_BRACKETS = "()[]"
# sympy can take very long on these (towers of powers, big exponents): such answers are not
# compared symbolically at all.
_NO_EVAL_SUBSTRINGS = ("^{", "^(")
_NO_EVAL_PATTERNS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))


def sympy_equal(given: str | None, truth: str | None) -> bool:
    """Whether `given` equals `truth` after normalisation, element-wise for tuples/intervals."""
    require("pylatexenc", "sympy")
    truth_n, given_n = _normalize(truth), _normalize(given)
    if truth_n is None:
        return False
    if truth_n == given_n:
        return True
    if given_n is None or not given_n:
        return False
    truth_items, given_items = _split_tuple(truth_n), _split_tuple(given_n)
    # A tuple or interval must open and close with the same brackets: (1, 3] is not [1, 3).
    if len(truth_items) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]):
        return False
    if len(truth_items) != len(given_items):
        return False
    return all(_items_equal(t, g) for t, g in zip(truth_items, given_items))


def _items_equal(truth: str, given: str) -> bool:
    if _FRACTION.search(truth) and _FRACTION.search(given):
        return truth == given  # an unreduced fraction is not the reduced one
    if _is_integer_text(truth) != _is_integer_text(given):
        return False  # an integer answer needs an integer, not an expression equal to it
    return _difference_is_zero(truth, given)


def _normalize(expr: str | None) -> str | None:
    """`expr` spelled plainly: no units, `$`, `%` or LaTeX; lower case; whole numbers as ints."""
    if expr is None:
        return None
    return functools.reduce(lambda text, step: step(text), _NORMALIZE_STEPS, expr)


def _replace_all(text: str, pairs: tuple[tuple[str, str], ...]) -> str:
    for old, new in pairs:
        text = text.replace(old, new)
    return text


def _unwrap_text(expr: str) -> str:
    wrapped = _WRAPPED_IN_TEXT.search(expr)
    return expr if wrapped is None else wrapped.group("inner")


def _delete_units(expr: str) -> str:
    for unit in _UNIT_PATTERNS:  # one after the other: deleting one can expose the next
        expr = unit.sub("", expr)
    return _DEGREE_SIGN.sub("", expr)


def _strip_outer_braces(expr: str) -> str:
    return expr[1:-1] if expr.startswith("{") and expr.endswith("}") else expr


def _round_if_whole(expr: str) -> str:
    value = _as_float(expr)
    return str(round(value)) if value is not None and _is_whole(value) else expr


def _latex_to_plain(expr: str) -> str:
    if "\\" not in expr:
        return expr
    from pylatexenc.latex2text import LatexNodes2Text

    try:
        plain = LatexNodes2Text().latex_to_text(_replace_all(expr, _FRAC_SPELLINGS))
    except Exception:  # pylatexenc fails on some inputs; the expression stays LaTeX then
        return expr
    return _replace_all(plain, _UNICODE_TO_SYMPY).strip()


def _int_if_integer(expr: str) -> str:
    return str(int(float(expr.replace(",", "")))) if _is_integer_text(expr) else expr


# The normalisation, applied in this order.
_NORMALIZE_STEPS: tuple[Callable[[str], str], ...] = (
    _unwrap_text,
    lambda e: _replace_all(e, _LITERAL_EDITS),
    _delete_units,
    _strip_outer_braces,
    lambda e: _THIN_SPACE_COMMA.sub("", e),
    _round_if_whole,
    _latex_to_plain,
    lambda e: _MINUS_SPACES.sub("-", e),
    lambda e: _MIXED_NUMBER.sub(r"\1+\2", e),  # "7 3/4" reads as 7 + 3/4
    lambda e: _replace_all(e, _DELETED_LAST).lower(),
    _int_if_integer,
)


def _as_float(text: str) -> float | None:
    try:
        return float(text)
    except (ValueError, TypeError):
        return None


def _is_whole(value: float) -> bool:
    try:
        return abs(value - round(value)) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def _drop_thousands_commas(expr: str) -> str:
    previous = None
    while expr != previous:  # repeated: "1,000,000" needs two passes
        previous, expr = expr, _THOUSANDS_COMMA.sub(r"\1\2\3", expr)
    return expr


def _is_integer_text(text: str) -> bool:
    value = _as_float(_drop_thousands_commas(text))
    return value is not None and _is_whole(value)


def _split_tuple(expr: str) -> list[str]:
    """`(1,2)` -> ["1", "2"]; anything not a flat bracketed tuple is one element."""
    expr = _drop_thousands_commas(expr)
    if not expr:
        return []
    opener, inner, closer = expr[0], expr[1:-1], expr[-1]
    flat = len(expr) > 2 and {opener, closer} <= set(_BRACKETS) and not set(inner) & set(_BRACKETS)
    return [item.strip() for item in inner.split(",")] if flat else [expr]


def _may_evaluate(expr: str) -> bool:
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2:
        return False  # words or many variables: not a closed-form answer
    if any(s in expr for s in _NO_EVAL_SUBSTRINGS):
        return False
    return not any(p.search(expr) for p in _NO_EVAL_PATTERNS)


def _difference_is_zero(truth: str, given: str) -> bool:
    difference = f"({truth})-({given})"
    if not _may_evaluate(difference):
        return False
    import sympy

    try:
        return bool(sympy.simplify(_parse(difference)) == 0)
    except Exception:  # a parse or simplify failure means "not shown equal", as in the reference
        return False


def _parse(expr: str) -> Any:
    from sympy.parsing import sympy_parser

    transformations = (
        *sympy_parser.standard_transformations,
        sympy_parser.implicit_multiplication_application,
    )
    # parse_expr evaluates Python: it sees sympy's public names and no builtins.
    return sympy_parser.parse_expr(
        expr.replace("^", "**"),
        local_dict={},
        global_dict={"__builtins__": {}, **_sympy_names()},
        transformations=transformations,
    )


@functools.cache
def _sympy_names() -> dict[str, Any]:
    import sympy

    return {name: value for name, value in vars(sympy).items() if not name.startswith("_")}
