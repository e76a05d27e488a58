"""`slime.rollout.rm_hub.math_utils`: the boxed-answer helpers slime's plugins import, on our
graders (slime.rollout.rm_hub.math_rules). sympy and pylatexenc are needed by the graders only."""

from __future__ import annotations

from typing import Any

from slime.rollout.rm_hub.boxed import last_boxed
from slime.rollout.rm_hub.math_rules import math_reward
from slime.rollout.rm_hub.mathd import mathd_normalize
from slime.rollout.rm_hub.sympy_grader import sympy_equal

__all__ = [
    "extract_answer",
    "extract_boxed_answer",
    "grade_answer_mathd",
    "grade_answer_sympy",
    "grade_answer_verl",
]


def extract_answer(passage: str) -> str | None:
    """The content of the last \\boxed{} in `passage`, or None (as the math rules read it)."""
    return last_boxed(passage)


extract_boxed_answer = extract_answer


def grade_answer_mathd(given_answer: str, ground_truth: str) -> bool:
    """Equal after the MATH dataset's normalisation (units, spaces, LaTeX spellings)."""
    return mathd_normalize(ground_truth) == mathd_normalize(given_answer)


def grade_answer_sympy(given_answer: str, ground_truth: str) -> bool:
    """Equal as expressions (sympy decides; tuples item by item)."""
    return sympy_equal(given_answer, ground_truth)


def grade_answer_verl(solution_str: str, ground_truth: Any) -> bool:
    """The last boxed answer of `solution_str` equals `ground_truth` (itself maybe boxed):
    `--rm-type math`'s rule."""
    return bool(math_reward(solution_str, ground_truth))
