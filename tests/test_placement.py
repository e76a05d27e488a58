"""Placement layouts (pure logic)."""

from __future__ import annotations

from slime.config.arguments import ClusterConfig
from slime.ray.placement import plan_placement


def test_disaggregated_cpu():
    p = plan_placement(ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=3))
    assert p.resource == "CPU" and p.num_bundles == 5
    assert [s.bundles for s in p.train] == [(0,), (1,)]
    assert [s.bundles for s in p.engines] == [(2,), (3,), (4,)]
    assert all(s.share == 1.0 for s in (*p.train, *p.engines))
    assert p.bundle_specs() == [{"CPU": 1.0}] * 5


def test_colocated_gpu_with_tensor_parallel_engines():
    cluster = ClusterConfig(
        actor_num_nodes=2,
        actor_num_gpus_per_node=4,
        rollout_num_gpus=8,
        rollout_num_gpus_per_engine=4,
        colocate=True,
        rollout_backend="sglang",
        device="cuda",
    )
    p = plan_placement(cluster)
    assert p.num_bundles == 8 and p.bundle_specs()[0] == {"GPU": 1.0, "CPU": 1.0}
    assert [s.bundles for s in p.engines] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    shares = [s.share for s in p.train] + [s.share for s in p.engines]
    assert all(0 < x < 1 for x in shares) and p.train[0].share + p.engines[0].share <= 1.0
    assert "engine 1: bundle(s) 4, 5, 6, 7" in "\n".join(p.describe())


def test_debug_layouts_leave_a_side_out():
    cluster = ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=2, colocate=True)
    assert plan_placement(cluster, with_trainer=False).train == ()
    only_train = plan_placement(cluster, with_engines=False)
    assert only_train.engines == () and only_train.num_bundles == 2 and only_train.train[0].share == 1.0


def test_a_ppo_critic_shares_the_train_bundles_when_colocated_and_follows_the_engines_when_not():
    import pytest

    colocated = plan_placement(
        ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=2, colocate=True), num_critic=2
    )
    assert colocated.num_bundles == 2 and [s.bundles for s in colocated.critic] == [(0,), (1,)]
    shares = colocated.train[0].share + colocated.critic[0].share + colocated.engines[0].share
    assert shares <= 1.0 and colocated.critic[0].share > 0
    apart = plan_placement(ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=3), num_critic=2)
    assert apart.num_bundles == 7 and [s.bundles for s in apart.critic] == [(5,), (6,)]
    assert [s.bundles for s in apart.engines] == [(2,), (3,), (4,)]  # the engines keep their bundles
    assert "critic rank 1: bundle 6 (1 CPU)" in apart.describe()
    with pytest.raises(ValueError, match="3 critic ranks for 2 train ranks"):
        plan_placement(
            ClusterConfig(actor_num_gpus_per_node=2, rollout_num_gpus=2, colocate=True), num_critic=3
        )
    rollout_only = plan_placement(ClusterConfig(actor_num_gpus_per_node=2), with_trainer=False, num_critic=2)
    assert rollout_only.critic == ()


def test_the_opd_teacher_engine_gets_bundles_of_its_own_at_the_end():
    """--opd-type sglang --opd-teacher-load: --rollout-num-gpus-per-engine whole bundles after every
    other, colocated or not (it scores while the engines generate); none without engines."""
    colocated = ClusterConfig(
        actor_num_gpus_per_node=2,
        rollout_num_gpus=2,
        rollout_num_gpus_per_engine=2,
        colocate=True,
        device="cuda",
        rollout_backend="sglang",
    )
    p = plan_placement(colocated, num_critic=2, teacher=True)
    assert p.num_bundles == 4 and [(s.bundles, s.share) for s in p.teacher] == [((2, 3), 1.0)]
    assert "OPD teacher engine: bundle(s) 2, 3 (1 GPU each)" in p.describe()
    apart = plan_placement(ClusterConfig(actor_num_gpus_per_node=1, rollout_num_gpus=2), teacher=True)
    assert apart.num_bundles == 4 and [s.bundles for s in apart.teacher] == [(3,)]
    train_only = plan_placement(ClusterConfig(actor_num_gpus_per_node=1), with_engines=False, teacher=True)
    assert train_only.teacher == () and train_only.num_bundles == 1
