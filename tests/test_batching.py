"""How a rollout is cut into steps, data-parallel shares and micro-batches."""

from __future__ import annotations

import pytest

from slime.utils import batching


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


def _batch(lengths: list[int], rewards: list[float] | None = None):
    from slime.utils.batch import RolloutBatch

    n = len(lengths)
    return RolloutBatch(
        tokens=[list(range(1, k + 1)) for k in lengths],
        response_lengths=[k - 1 for k in lengths],
        rewards=rewards or [float(i % 2) for i in range(n)],
        group_indices=[i // 2 for i in range(n)],
        loss_masks=[[1] * (k - 2) + [0] for k in lengths],
    )


def test_split_rollout_gives_each_replica_the_share_it_plans_with():
    from slime.config.train import BatchConfig
    from slime.utils.batch import split_rollout

    lengths = [9, 3, 7, 4, 12, 5, 6, 8]
    batch = _batch(lengths)
    parts = split_rollout(batch, BatchConfig(global_batch_size=4, micro_batch_size=1), 2)
    steps = batching.step_shares(lengths, 4, 2)
    for d, part in enumerate(parts):
        assert part.positions == sorted(p for step in steps for p in step[d])
        assert part.batch.tokens == [batch.tokens[p] for p in part.positions]
        assert part.batch.sample_indices == part.positions
        # The whole rollout's per-sample numbers travel with every part.
        assert part.lengths == lengths and part.rewards == batch.rewards and part.dp_size == 2
        assert part.loss_tokens == [k - 2 for k in lengths]
    assert sorted(p for part in parts for p in part.positions) == list(range(8))
    # The layout is checked the way the train ranks check it.
    with pytest.raises(ValueError, match="--global-batch-size 4 is not divisible"):
        split_rollout(batch, BatchConfig(global_batch_size=4, micro_batch_size=3), 2)


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_rank_plans_its_part_like_its_share_of_the_whole_rollout(tiny_model, dynamic):
    from slime.backends.train_common import TrainActorBase
    from slime.config.train import BatchConfig, TrainConfig
    from slime.utils.batch import BatchError, split_rollout

    lengths = [9, 3, 7, 4, 12, 5, 6, 8]
    batch = _batch(lengths)
    cfg = TrainConfig(
        hf_checkpoint=tiny_model,
        batch=BatchConfig(global_batch_size=4, micro_batch_size=1, use_dynamic_batch_size=dynamic,
                          max_tokens_per_gpu=16 if dynamic else None),
    )  # fmt: skip
    parts = split_rollout(batch, cfg.batch, 2)
    for d in range(2):
        rank = TrainActorBase()
        rank.cfg, rank.dp_rank, rank.dp_size = cfg, d, 2
        whole = rank.plan(batch)
        mine = rank.plan(parts[d])
        # The same micro-batches, named by position in the part instead of in the rollout.
        assert [[[parts[d].positions[p] for p in mb] for mb in s.micro_batches] for s in mine] == [
            s.micro_batches for s in whole
        ]
        assert [(s.num_samples, s.num_tokens) for s in mine] == [(s.num_samples, s.num_tokens) for s in whole]
    rank = TrainActorBase()
    rank.cfg, rank.dp_rank, rank.dp_size = cfg, 0, 2
    with pytest.raises(BatchError, match="without sample"):
        rank.plan(parts[1])  # another replica's part
    rank.dp_size = 4
    with pytest.raises(BatchError, match="split for 2 data-parallel replicas, but this job trains on 4"):
        rank.plan(parts[0])
