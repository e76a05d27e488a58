"""The critic's settings (`--advantage-estimator ppo` turns it on, as in slime): its own train
ranks, where it starts from and saves to, its learning rate, and the critic-only warm-up.

slime sets a critic's load, save and learning rate in a `--megatron-config-path` YAML (role
`critic`); here they are flags (`--critic-load`, `--critic-save`, `--critic-lr`,
`--critic-num-nodes`, `--critic-num-gpus-per-node`). Everything else is the actor's: the critic
trains with the actor's batch layout, optimizer settings (but its own warm-up,
`--critic-lr-warmup-iters`, 0 as in slime), backend and seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

from slime.config.flags import add_flags, flag, from_flags
from slime.config.lora import LoRAConfig
from slime.config.opd import OPDConfig
from slime.config.train import TrainConfig


@dataclass(frozen=True, kw_only=True)
class CriticConfig:
    num_critic_only_steps: int = flag("--num-critic-only-steps", 0)
    """the first N rollouts train the critic only; the actor's weights stay (slime's)"""
    load: str | None = flag("--critic-load", None)
    """Hugging Face directory the critic starts from (default: --hf-checkpoint with a fresh value
    head; a critic's --save-hf export keeps its head)"""
    save: str | None = flag("--critic-save", None)
    """the critic's checkpoints (default: <--save>/critic)"""
    lr: float | None = flag("--critic-lr", None, type=float)
    """the critic's learning rate (default: --lr)"""
    lr_warmup_iters: int = flag("--critic-lr-warmup-iters", 0)
    """the critic's learning-rate warm-up steps (slime's; 0: none, whatever --lr-warmup-iters says);
    its decay follows the actor's --lr-decay-style and --min-lr"""
    num_nodes: int = flag("--critic-num-nodes", 1, unset=None, type=int)
    """default: --actor-num-nodes"""
    num_gpus_per_node: int = flag("--critic-num-gpus-per-node", 1, unset=None, type=int)
    """default: --actor-num-gpus-per-node"""
    train: TrainConfig
    """The critic ranks' config: the actor's, with the critic's model, learning rate and checkpoints."""

    @property
    def num_ranks(self) -> int:
        return self.num_nodes * self.num_gpus_per_node


def add_critic_arguments(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, CriticConfig, "train: critic (PPO: --advantage-estimator ppo)")


def critic_config(ns: argparse.Namespace, actor: TrainConfig) -> CriticConfig | None:
    """The critic of a PPO run (None for the other estimators; its flags are then refused)."""
    given = [
        f
        for f, v in (
            ("--critic-load", ns.critic_load),
            ("--critic-save", ns.critic_save),
            ("--critic-lr", ns.critic_lr),
            ("--critic-num-nodes", ns.critic_num_nodes),
            ("--critic-lr-warmup-iters", ns.critic_lr_warmup_iters or None),
            ("--critic-num-gpus-per-node", ns.critic_num_gpus_per_node),
            ("--num-critic-only-steps", ns.num_critic_only_steps or None),
        )
        if v is not None
    ]
    if actor.loss.advantage_estimator != "ppo":
        if given:
            raise ValueError(f"{given[0]} sets the critic, which only --advantage-estimator ppo has")
        return None
    if ns.num_critic_only_steps < 0:
        raise ValueError(f"--num-critic-only-steps must be >= 0, got {ns.num_critic_only_steps}")
    if actor.loss.loss_type != "policy_loss":
        raise ValueError(
            f"--advantage-estimator ppo trains a policy: --loss-type {actor.loss.loss_type} has no advantages"
        )
    nodes = ns.critic_num_nodes or ns.actor_num_nodes
    per_node = ns.critic_num_gpus_per_node or ns.actor_num_gpus_per_node
    if nodes * per_node != ns.actor_num_nodes * ns.actor_num_gpus_per_node:
        raise ValueError(
            f"--critic-num-nodes x --critic-num-gpus-per-node = {nodes * per_node} critic ranks: the "
            "critic trains the actor's data-parallel parts of each rollout, so it needs as many ranks as "
            f"the actor ({ns.actor_num_nodes * ns.actor_num_gpus_per_node})"
        )
    if ns.critic_save and not ns.save:
        raise ValueError("--critic-save needs --save: the critic saves when the actor does")
    if ns.critic_save and any(
        os.path.realpath(ns.critic_save) == os.path.realpath(d) for d in (ns.save, ns.load) if d
    ):
        raise ValueError(
            f"--critic-save {ns.critic_save!r} is the actor's --save / --load: the critic's checkpoints "
            "would replace the actor's; give it a directory of its own (the default is <--save>/critic)"
        )
    save = ns.critic_save or (os.path.join(ns.save, "critic") if ns.save else None)
    # A resumed run (--load) resumes its critic from where the critic saved: <--load>/critic unless
    # --critic-save names the place.
    load = (ns.critic_save or os.path.join(ns.load, "critic")) if ns.load else None
    optimizer = dataclasses.replace(
        actor.optimizer,
        lr=actor.optimizer.lr if ns.critic_lr is None else ns.critic_lr,
        lr_warmup_iters=ns.critic_lr_warmup_iters,
    )
    train = dataclasses.replace(
        actor,
        hf_checkpoint=ns.critic_load or actor.hf_checkpoint,
        load=load,
        ref_load=None,
        optimizer=optimizer,
        # The critic computes no log-probs: no reference (nor its updates), no old actor's copies,
        # no routing replay, no train-data dumps.
        loss=dataclasses.replace(
            actor.loss, use_kl_loss=False, kl_coef=0.0, ref_update_interval=None, keep_old_actor=False
        ),
        moe=dataclasses.replace(actor.moe, use_routing_replay=False, use_rollout_routing_replay=False),
        save_debug_train_data=None,
        opd=OPDConfig(),  # the teacher is the actor's business
        lora=LoRAConfig(),  # the critic trains all its weights (docs/lora.md)
    )
    return from_flags(CriticConfig, ns, train=train, num_nodes=nodes, num_gpus_per_node=per_node, save=save)
