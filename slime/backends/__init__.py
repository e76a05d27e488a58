"""Train backends: FSDP2 (slime.backends.fsdp) and megatron-core (slime.backends.megatron)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, overload

if TYPE_CHECKING:
    from slime.backends.interface import CriticActor, TrainActor
    from slime.config.train import TrainConfig


@overload
def make_train_actor(
    cfg: TrainConfig,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    critic: Literal[False] = False,
) -> TrainActor: ...


@overload
def make_train_actor(
    cfg: TrainConfig,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    *,
    critic: Literal[True],
) -> CriticActor: ...


@overload
def make_train_actor(
    cfg: TrainConfig,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    critic: bool = False,
) -> TrainActor | CriticActor: ...


def make_train_actor(
    cfg: TrainConfig,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    critic: bool = False,
) -> TrainActor | CriticActor:
    """The train actor of `cfg.backend` (imported lazily: megatron-core is optional); with
    `critic`, PPO's critic (slime.backends.value)."""
    if critic and cfg.backend == "megatron":
        from slime.backends.megatron.critic import MegatronCritic

        return MegatronCritic(cfg, rank, world_size, init_method)
    if critic:
        from slime.backends.fsdp.critic import FSDPCritic

        return FSDPCritic(cfg, rank, world_size, init_method)
    if cfg.backend == "megatron":
        from slime.backends.megatron.actor import MegatronTrainActor

        return MegatronTrainActor(cfg, rank, world_size, init_method)
    from slime.backends.fsdp.actor import FSDPTrainActor

    return FSDPTrainActor(cfg, rank, world_size, init_method)
