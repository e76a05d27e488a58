"""Train backends: FSDP2 (slime.backends.fsdp) and megatron-core (slime.backends.megatron)."""

from __future__ import annotations

from typing import Any


def make_train_actor(
    cfg: Any,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    critic: bool = False,
) -> Any:
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
