"""`slime.rollout.rm_hub.math_dapo_utils.compute_score`, as slime's plugins import it: DAPO's
reward on our implementation (slime.rollout.rm_hub.dapo)."""

from __future__ import annotations

from typing import Any

from slime.rollout.rm_hub.dapo import dapo_reward, normalize_final_answer

__all__ = ["compute_score", "normalize_final_answer"]

STRICT_TAIL_CHARS = 100


def _last_braced_box(text: str) -> str | None:
    """The content of the last `\\boxed{` in `text`, braces balanced (DAPO's strict reading)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start + len("\\boxed{") : i]
    return None


def compute_score(
    solution_str: str,
    ground_truth: Any,
    strict_box_verify: bool = False,
    pause_tokens_index: list[int] | None = None,
) -> dict[str, Any]:
    """{"score": 1.0 | -1.0, "acc", "pred"}. Default: the last "Answer:" line against the
    integer label (`--rm-type dapo`). `strict_box_verify`: the last \\boxed{} within the last 100
    characters (before the fourth pause token when `pause_tokens_index` gives them) must equal
    the label exactly."""
    if not strict_box_verify:
        return dapo_reward(solution_str, ground_truth)
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index must hold 4 positions, got {len(pause_tokens_index)}")
        tail = solution_str[pause_tokens_index[-1] - STRICT_TAIL_CHARS :]
    else:
        tail = solution_str[-STRICT_TAIL_CHARS:]
    pred = _last_braced_box(tail)
    correct = pred == ground_truth
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
