"""What a `--rollout-function-path` function returns (slime's types).

`f(args, rollout_id, data_source, evaluation=False)` returns, for training, a
`RolloutFnTrainOutput` (groups of samples, and metrics logged with the rollout's) or, as slime's
older functions do, the groups alone; for evaluation a `RolloutFnEvalOutput` whose `data` maps a
set's name to `{"samples": [...], ...}`, or the samples alone. `number_groups` checks the groups
and numbers their samples.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slime.utils.sample import Sample

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


def number_groups(result: Any, n_samples_per_prompt: int, flag: str) -> list[Sample]:
    """A rollout function's result (groups, or a flat list in groups of n) as numbered samples."""
    if not isinstance(result, list | tuple) or not result:
        raise TypeError(f"{flag} must return a non-empty list of sample groups, got {type(result).__name__}")
    if all(isinstance(s, Sample) for s in result):
        if len(result) % n_samples_per_prompt:
            raise ValueError(
                f"{flag} returned {len(result)} samples, not groups of --n-samples-per-prompt "
                f"{n_samples_per_prompt}"
            )
        result = [result[i : i + n_samples_per_prompt] for i in range(0, len(result), n_samples_per_prompt)]
    samples: list[Sample] = []
    executions: dict[tuple[int, int], int] = {}
    for group_index, group in enumerate(result):
        if not isinstance(group, list | tuple) or not all(isinstance(s, Sample) for s in group):
            raise TypeError(f"{flag} must return lists of Sample (group {group_index} is not)")
        for s in group:
            s.group_index, s.index = group_index, len(samples)
            if s.rollout_id is not None:  # an execution's id: the index of its first sample
                s.rollout_id = executions.setdefault((group_index, s.rollout_id), s.index)
            samples.append(s)
    return samples
