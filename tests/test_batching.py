"""How a rollout is cut into steps, data-parallel shares and micro-batches."""

from __future__ import annotations

import pytest

from slime.backends import batching


def test_split_steps_in_rollout_order_and_refuses_remainders():
    assert batching.split_steps(6, 3) == [[0, 1, 2], [3, 4, 5]]
    assert batching.split_steps(4, None) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="--global-batch-size 4"):
        batching.split_steps(6, 4)


def test_balanced_shares_equal_counts_similar_tokens():
    lengths = [100, 90, 10, 10, 50, 40, 5, 5]
    shares = batching.balanced_shares(range(8), lengths, 2)
    assert sorted(i for s in shares for i in s) == list(range(8))
    assert [len(s) for s in shares] == [4, 4]
    totals = [sum(lengths[i] for i in s) for s in shares]
    assert abs(totals[0] - totals[1]) <= 20, totals
    # contiguous halves would give 250 vs 60
    assert all(s == sorted(s) for s in shares)
    with pytest.raises(ValueError, match="evenly"):
        batching.balanced_shares(range(5), [1] * 5, 2)


def test_pack_micro_batches_respects_padded_budget():
    lengths = [30, 8, 9, 10, 7, 60]
    batches = batching.pack_micro_batches(range(6), lengths, max_tokens=32)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert batching.padded_tokens(b, lengths) <= 32 or len(b) == 1
    assert [5] in batches  # longer than the budget: alone
    assert any(len(b) == 3 for b in batches)  # 10, 9, 8 -> 30 padded tokens


def test_split_to_count_splits_largest_first():
    assert batching.split_to_count([[1, 2, 3, 4], [5]], 3) == [[1, 2], [3, 4], [5]]
    assert batching.split_to_count([[1], [2]], 2) == [[1], [2]]
    with pytest.raises(ValueError, match="cannot split"):
        batching.split_to_count([[1]], 2)


def test_fixed_micro_batches():
    assert batching.fixed_micro_batches([4, 5, 6, 7, 8], 2) == [[4, 5], [6, 7], [8]]
