"""Which process goes in which Ray placement-group bundle (pure logic; Ray is used elsewhere).

One bundle per device. On a GPU cluster a bundle is one GPU (plus a CPU); on a machine without
GPUs a "GPU" is one CPU process, so a bundle is one CPU. Disaggregated: train ranks take the
first bundles, engines the rest. Colocated: engine j shares the bundles of train ranks
[j·tp, (j+1)·tp), and both sides ask for a fraction of each bundle so Ray packs them together.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from slime.config.arguments import ClusterConfig, Config

# Shares of a colocated bundle; they only need to fit together in one bundle. With a critic
# (PPO) its ranks join the train ranks' bundles too, and the three share each.
TRAIN_SHARE = 0.5
ENGINE_SHARE = 0.5
CRITIC_SHARES = (0.4, 0.2, 0.4)  # train, critic, engine


@dataclass(frozen=True)
class Slot:
    """Where one process goes: its bundle(s) and how much of each it asks for."""

    bundles: tuple[int, ...]
    share: float


@dataclass(frozen=True)
class Placement:
    resource: str  # "GPU" or "CPU"
    num_bundles: int
    train: tuple[Slot, ...]
    engines: tuple[Slot, ...]
    critic: tuple[Slot, ...] = ()
    teacher: tuple[Slot, ...] = ()
    """The OPD teacher engine the job starts (--opd-teacher-load with --opd-type sglang): bundles
    of its own after every other, never shared (it scores while the engines generate)."""

    def bundle_specs(self) -> list[dict[str, float]]:
        if self.resource == "GPU":
            return [{"GPU": 1.0, "CPU": 1.0} for _ in range(self.num_bundles)]
        return [{"CPU": 1.0} for _ in range(self.num_bundles)]

    def describe(self) -> list[str]:
        lines = [f"{self.num_bundles} bundles of 1 {self.resource}"]
        for rank, slot in enumerate(self.train):
            lines.append(f"train rank {rank}: bundle {slot.bundles[0]} ({slot.share:g} {self.resource})")
        for j, slot in enumerate(self.engines):
            where = ", ".join(map(str, slot.bundles))
            lines.append(f"engine {j}: bundle(s) {where} ({slot.share:g} {self.resource} each)")
        for rank, slot in enumerate(self.critic):
            lines.append(f"critic rank {rank}: bundle {slot.bundles[0]} ({slot.share:g} {self.resource})")
        for slot in self.teacher:
            lines.append(
                f"OPD teacher engine: bundle(s) {', '.join(map(str, slot.bundles))} (1 {self.resource} each)"
            )
        return lines


def plan_placement(
    cluster: ClusterConfig,
    with_trainer: bool = True,
    with_engines: bool = True,
    num_critic: int = 0,
    teacher: bool = False,
) -> Placement:
    """The bundles and slots for a layout (either side can be left out, as the debug modes do).
    `num_critic`: PPO's critic ranks: with --colocate in the train ranks' bundles (critic rank r
    with train rank r), else in bundles of their own after the engines'. `teacher`: the OPD
    teacher engine, --rollout-num-gpus-per-engine bundles of its own at the end (only with engines)."""
    plan = _plan(cluster, with_trainer, with_engines, num_critic)
    if not (teacher and with_engines):
        return plan
    tp = cluster.rollout_num_gpus_per_engine
    slot = Slot(tuple(range(plan.num_bundles, plan.num_bundles + tp)), 1.0)
    return dataclasses.replace(plan, num_bundles=plan.num_bundles + tp, teacher=(slot,))


def _plan(cluster: ClusterConfig, with_trainer: bool, with_engines: bool, num_critic: int) -> Placement:
    resource = "GPU" if cluster.device == "cuda" else "CPU"
    tp = cluster.rollout_num_gpus_per_engine
    num_train = cluster.num_train_ranks if with_trainer else 0
    num_critic = num_critic if with_trainer else 0
    # External engines (--rollout-external-engine-addrs) run elsewhere: no bundle for them.
    num_engines = cluster.num_engines if with_engines and not cluster.external_engine_addrs else 0
    if cluster.colocate and with_trainer and with_engines:
        if num_critic > num_train:
            raise ValueError(
                f"--colocate puts each critic rank with a train rank: {num_critic} critic ranks for "
                f"{num_train} train ranks (give --critic-num-nodes / --critic-num-gpus-per-node at most "
                "the actor's)"
            )
        train_share, critic_share, engine_share = (
            CRITIC_SHARES if num_critic else (TRAIN_SHARE, 0.0, ENGINE_SHARE)
        )
        train = tuple(Slot((r,), train_share) for r in range(num_train))
        engines = tuple(Slot(tuple(range(j * tp, (j + 1) * tp)), engine_share) for j in range(num_engines))
        critic = tuple(Slot((r,), critic_share) for r in range(num_critic))
        return Placement(resource, num_train, train, engines, critic)
    train = tuple(Slot((r,), 1.0) for r in range(num_train))
    engines = tuple(
        Slot(tuple(range(num_train + j * tp, num_train + (j + 1) * tp)), 1.0) for j in range(num_engines)
    )
    first = num_train + num_engines * tp
    critic = tuple(Slot((first + r,), 1.0) for r in range(num_critic))
    return Placement(resource, first + num_critic, train, engines, critic)


def job_placement(config: Config) -> Placement:
    """The placement of a job's processes, from its configuration."""
    d = config.debug
    return plan_placement(
        config.cluster,
        not d.rollout_only,
        not d.train_only,
        config.critic.num_ranks if config.critic else 0,
        config.opd.teacher_engine,
    )


def data_parallel_size(config: Config) -> int:
    """The data-parallel replicas of the train ranks (Megatron: ranks / (TP x PP x CP))."""
    c, t = config.cluster, config.train
    model_parallel = 1
    if t.backend == "megatron":
        m = t.megatron
        model_parallel = (
            m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
        )
    return max(1, c.num_train_ranks // model_parallel)
