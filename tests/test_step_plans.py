"""How a rollout is cut into steps, data-parallel shares and micro-batches."""

from __future__ import annotations

import pytest

from slime.utils import step_plans


def test_split_steps_in_rollout_order_and_refuses_remainders():
    assert step_plans.split_steps(6, 3) == [[0, 1, 2], [3, 4, 5]]
    assert step_plans.split_steps(4, None) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="--global-batch-size 4"):
        step_plans.split_steps(6, 4)


def test_balanced_shares_equal_counts_similar_tokens():
    lengths = [100, 90, 10, 10, 50, 40, 5, 5]
    shares = step_plans.balanced_shares(range(8), lengths, 2)
    assert sorted(i for s in shares for i in s) == list(range(8))
    assert [len(s) for s in shares] == [4, 4]
    totals = [sum(lengths[i] for i in s) for s in shares]
    assert abs(totals[0] - totals[1]) <= 20, totals
    # contiguous halves would give 250 vs 60
    assert all(s == sorted(s) for s in shares)
    # A count the ranks do not divide (several samples per execution): counts one apart.
    uneven = step_plans.balanced_shares(range(7), [9, 1, 1, 1, 1, 1, 1], 2)
    assert uneven == [
        [0, 4, 5, 6],
        [1, 2, 3],
    ]  # the larger count first; the long sample balanced by short ones
    with pytest.raises(ValueError, match="one"):
        step_plans.balanced_shares(range(1), [1], 2)


def test_pack_micro_batches_respects_padded_budget():
    lengths = [30, 8, 9, 10, 7, 60]
    batches = step_plans.pack_micro_batches(range(6), lengths, max_tokens=32)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert step_plans.padded_tokens(b, lengths) <= 32 or len(b) == 1
    assert [5] in batches  # longer than the budget: alone
    assert any(len(b) == 3 for b in batches)  # 10, 9, 8 -> 30 padded tokens


def test_split_to_count_splits_largest_first():
    assert step_plans.split_to_count([[1, 2, 3, 4], [5]], 3) == [[1, 2], [3, 4], [5]]
    assert step_plans.split_to_count([[1], [2]], 2) == [[1], [2]]
    with pytest.raises(ValueError, match="cannot split"):
        step_plans.split_to_count([[1]], 2)


def test_fixed_micro_batches():
    assert step_plans.fixed_micro_batches([4, 5, 6, 7, 8], 2) == [[4, 5], [6, 7], [8]]


def _batch(lengths: list[int], rewards: list[float] | None = None):
    from slime.utils.rollout_batch import RolloutBatch

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
    from slime.utils.rollout_batch import split_rollout

    lengths = [9, 3, 7, 4, 12, 5, 6, 8]
    batch = _batch(lengths)
    parts = split_rollout(batch, BatchConfig(global_batch_size=4, micro_batch_size=1), 2)
    steps = step_plans.step_shares(lengths, 4, 2)
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
    from types import SimpleNamespace

    from slime.backends.planning import plan
    from slime.config.train import BatchConfig, TrainConfig
    from slime.utils.rollout_batch import BatchError, split_rollout

    lengths = [9, 3, 7, 4, 12, 5, 6, 8]
    batch = _batch(lengths)
    cfg = TrainConfig(
        hf_checkpoint=tiny_model,
        batch=BatchConfig(
            global_batch_size=4,
            micro_batch_size=1,
            use_dynamic_batch_size=dynamic,
            max_tokens_per_gpu=16 if dynamic else None,
        ),
    )
    parts = split_rollout(batch, cfg.batch, 2)
    for d in range(2):
        rank = SimpleNamespace(dp_rank=d, dp_size=2, context_parallel=1)
        whole = plan(cfg, rank, batch)
        mine = plan(cfg, rank, parts[d])
        # The same micro-batches, named by position in the part instead of in the rollout.
        assert [[[parts[d].positions[p] for p in mb] for mb in s.micro_batches] for s in mine] == [
            s.micro_batches for s in whole
        ]
        assert [(s.num_samples, s.num_tokens) for s in mine] == [(s.num_samples, s.num_tokens) for s in whole]
    rank = SimpleNamespace(dp_rank=0, dp_size=2, context_parallel=1)
    with pytest.raises(BatchError, match="without sample"):
        plan(cfg, rank, parts[1])  # another replica's part
    rank.dp_size = 4
    with pytest.raises(BatchError, match="split for 2 data-parallel replicas, but this job trains on 4"):
        plan(cfg, rank, parts[0])


def test_a_step_counts_executions_and_keeps_each_together():
    """slime's --global-batch-size with an agent session split into several samples: a step
    takes that many executions, all of an execution's samples in the same step."""
    executions = step_plans.execution_keys([7, 7, 3, None, 5, 5, 5, None], 8)
    assert executions == [0, 0, 1, 2, 3, 3, 3, 4]
    assert step_plans.execution_keys(None, 3) == [0, 1, 2]
    with pytest.raises(ValueError, match="5 executions"):
        step_plans.split_steps(8, 2, executions)
    executions = [0, 0, 1, 2, 2, 2, 3, 4, 5]
    assert step_plans.split_steps(9, 3, executions) == [[0, 1, 2, 3, 4, 5], [6, 7, 8]]
    # Interleaved siblings still land in one step, each step in rollout order.
    assert step_plans.split_steps(6, 2, [0, 1, 0, 2, 3, 2]) == [[0, 1, 2], [3, 4, 5]]


def test_ranks_holding_different_sample_counts_still_run_as_many_micro_batches():
    lengths = [5, 5, 5, 5, 5, 5, 5]
    shares = step_plans.balanced_shares(range(7), lengths, 2)  # 4 and 3 samples
    per_rank = [step_plans.fixed_micro_batches(s, 1) for s in shares]
    fitted, merged = step_plans.rank_micro_batches(per_rank, shares, lengths)
    assert merged and [len(m) for m in fitted] == [3, 3]
    assert [sorted(i for mb in m for i in mb) for m in fitted] == [sorted(s) for s in shares]
    # Equal shares never merge: the most any rank packed wins, the others split.
    shares = [[0, 1, 2, 3], [4, 5, 6, 7]]
    per_rank = [[[0, 1, 2, 3]], [[4], [5], [6, 7]]]
    fitted, merged = step_plans.rank_micro_batches(per_rank, shares, [1] * 8)
    assert not merged and [len(m) for m in fitted] == [3, 3]


def test_the_per_sample_loss_counts_each_execution_once():
    """Weights summed over an execution's tokens are 1 / executions, wherever its samples land
    (slime's rollout_mask_sums), on one rank or two."""
    import torch

    from slime.algo.losses import token_weights

    executions = [0, 0, 1, 2, 2, 2, 3, 4]  # 5 executions, 8 samples: one step
    loss_tokens = [3, 2, 4, 1, 2, 5, 2, 6]
    lengths = [t + 2 for t in loss_tokens]
    for dp in (1, 2):
        totals = dict.fromkeys(range(5), 0.0)
        for share in step_plans.step_shares(lengths, 5, dp, executions)[0]:
            local = {g: k for k, g in enumerate(share)}
            count, denominators = step_plans.execution_normalisers(range(8), loss_tokens, executions, local)
            assert count == 5 and denominators is not None
            step = step_plans.StepPlan([list(range(len(share)))], 8, sum(loss_tokens), count, denominators)
            masks = torch.zeros(len(share), 6)
            for row, g in enumerate(share):
                masks[row, : loss_tokens[g]] = 1
            w = token_weights(
                masks, False, step.num_executions, step.num_tokens, step.row_denominators(range(len(share)))
            )
            for row, g in enumerate(share):
                totals[executions[g]] += float(w[row].sum())
        assert all(abs(v - 0.2) < 1e-7 for v in totals.values()), (dp, totals)
    # Without several samples per execution the weights are those of plain samples.
    assert step_plans.execution_normalisers([0, 1], [3, 2], None, {0: 0, 1: 1}) == (2, None)


def test_balance_by_flops_cuts_the_token_budgets_count_and_evens_the_flops():
    lengths = [100, 90, 10, 10, 10, 10, 10, 10, 10, 10, 30, 30]
    indices = list(range(len(lengths)))
    batches = step_plans.flops_micro_batches(indices, lengths, max_tokens=120, coefficient=50.0)
    assert len(batches) == 3  # ceil(330 / 120)
    assert sorted(i for b in batches for i in b) == indices and all(b == sorted(b) for b in batches)

    def loads(bs):
        return [sum(lengths[i] * (50 + lengths[i]) for i in b) for b in bs]

    # the heaviest micro-batch is the longest sample alone (no split can do better); packing by
    # tokens gives three micro-batches too, two of them that heavy: [15000, 15000, 7200]
    assert loads(batches) == [15000, 12600, 9600]
    packed = step_plans.pack_micro_batches(indices, lengths, 120, packed=True)
    assert sorted(loads(packed), reverse=True) == [15000, 15000, 7200]
    assert step_plans.flops_micro_batches([0, 1], lengths, max_tokens=10, coefficient=1.0) == [[0], [1]]


def test_flops_coefficient_from_the_model_shape():
    from types import SimpleNamespace

    dense = SimpleNamespace(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=100,
    )
    linear = 2 * (2 * 64 * (4 + 4) * 16 + 2 * 64 * 64 + 6 * 64 * 128) + 2 * 64 * 100
    assert step_plans.flops_coefficient(dense) == pytest.approx(linear / (2 * 4 * 16 * 2))
