"""What a `--rollout-function-path` function returns (slime's types).

`f(args, rollout_id, data_source, evaluation=False)` returns, for training, a
`RolloutFnTrainOutput` (groups of samples, and metrics logged with the rollout's) or, as slime's
older functions do, the groups alone; for evaluation a `RolloutFnEvalOutput` whose `data` maps a
set's name to `{"samples": [...], ...}`, or the samples alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FLAG = "--rollout-function-path"


@dataclass
class RolloutFnTrainOutput:
    samples: list[Any]
    metrics: dict[str, Any] | None = None


@dataclass
class RolloutFnEvalOutput:
    data: dict[str, dict[str, Any]]
    metrics: dict[str, Any] | None = None


def unwrap(result: Any, evaluation: bool, eval_set: str | None = None) -> tuple[Any, dict[str, float]]:
    """(the samples or groups, the function's metrics) of a rollout function's result.

    For evaluation, `eval_set` names the set being evaluated: a RolloutFnEvalOutput holding
    several sets must hold it."""
    if isinstance(result, RolloutFnTrainOutput):
        if evaluation:
            raise TypeError(
                f"{FLAG} returned a RolloutFnTrainOutput for evaluation: return a RolloutFnEvalOutput"
            )
        return result.samples, dict(result.metrics or {})
    if isinstance(result, RolloutFnEvalOutput):
        if not evaluation:
            raise TypeError(
                f"{FLAG} returned a RolloutFnEvalOutput for a training rollout: return a RolloutFnTrainOutput"
            )
        data = result.data
        if eval_set in data:
            entry = data[eval_set]
        elif len(data) == 1:
            (entry,) = data.values()
        else:
            raise ValueError(
                f"{FLAG} returned evaluation data for {sorted(data)}, not for the set being evaluated "
                f"({eval_set})"
            )
        if not isinstance(entry, dict) or "samples" not in entry:
            raise TypeError(f"{FLAG}: each RolloutFnEvalOutput.data entry needs its 'samples'")
        return entry["samples"], dict(result.metrics or {})
    return result, {}
