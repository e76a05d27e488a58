"""slime's dynamic-sampling filters and rollout-function output types, without engines."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from slime.rollout.base_types import RolloutFnEvalOutput, RolloutFnTrainOutput, unwrap
from slime.rollout.filter_hub.base_types import DynamicFilterOutput, as_filter_output, drops
from slime.rollout.filter_hub.dynamic_sampling_filters import (
    check_reward_nonzero_std,
    check_reward_nonzero_std_with_fallback,
)
from slime.utils.sample import Sample


def group(*rewards):
    return [Sample(reward=r) for r in rewards]


def test_check_reward_nonzero_std_names_the_shared_reward():
    args = SimpleNamespace(reward_key=None)
    assert check_reward_nonzero_std(args, group(1.0, 0.0, 1.0)) == DynamicFilterOutput(True, None)
    assert check_reward_nonzero_std(args, group(1.0, 1.0, 1.0)) == DynamicFilterOutput(False, "zero_std_1.0")
    assert check_reward_nonzero_std(args, group(0.04, 0.04)).reason == "zero_std_0.0"
    keyed = SimpleNamespace(reward_key="score")
    out = check_reward_nonzero_std(keyed, group({"score": -1.0, "acc": False}, {"score": -1.0, "acc": False}))
    assert out == DynamicFilterOutput(False, "zero_std_-1.0")
    fallback = check_reward_nonzero_std_with_fallback(args, group(0.0, 0.0))
    assert not fallback.keep and fallback.keep_when_insufficient


def test_filter_results_are_read_as_slime_reads_them():
    assert as_filter_output(False) == DynamicFilterOutput(keep=False)
    torch = pytest.importorskip("torch")
    assert as_filter_output(torch.tensor(True)) == DynamicFilterOutput(keep=True)
    with pytest.raises(TypeError, match="got dict"):
        as_filter_output({"keep": False})
    rejected = DynamicFilterOutput(keep=False, keep_when_insufficient=True)
    assert not drops(rejected, candidates=4, wanted=4) and drops(rejected, candidates=5, wanted=4)
    assert drops(DynamicFilterOutput(keep=False), candidates=1, wanted=4)


def test_rollout_function_outputs_unwrap():
    groups = [group(1.0, 0.0)]
    assert unwrap(groups, evaluation=False) == (groups, {})
    assert unwrap(RolloutFnTrainOutput(groups, {"m": 1.0}), evaluation=False) == (groups, {"m": 1.0})
    flat = group(1.0)
    out = RolloutFnEvalOutput({"aime": {"samples": flat, "rewards": [1.0]}, "gsm": {"samples": []}})
    assert unwrap(out, evaluation=True, eval_set="aime") == (flat, {})
    with pytest.raises(
        ValueError, match=r"evaluation data for \['aime', 'gsm'\], not for the set being evaluated"
    ):
        unwrap(out, evaluation=True, eval_set="math")
    with pytest.raises(TypeError, match="RolloutFnTrainOutput for evaluation"):
        unwrap(RolloutFnTrainOutput(groups), evaluation=True)
