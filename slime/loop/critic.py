"""PPO's actor and critic as one train group (slime.loop.parts.TrainGroup): the loop drives it like
any trainer, and the critic is a part of it, not a branch of the loop.

Per rollout:

1. the critic computes the value of every response token (before its update: V_old);
2. the actor trains with them: its log-prob and reference passes, GAE of the rewards (with
   --kl-coef's shaping by the real KL) over those values, its optimizer steps; its output
   carries the returns;
3. the critic trains on those returns (the clipped value loss around V_old).

slime's critic computes its own returns, without the KL, before the actor runs; taking the
actor's keeps the critic's targets and the actor's advantages one computation
(docs/ppo.md). With --num-critic-only-steps N the actor takes no step in the first N rollouts
(it still computes the returns; its unchanged weights are pushed as usual).

Values and returns travel between the ranks by reference (object references in a Ray job), by data-parallel
part, so each rank fetches only its own part's: the driver holds none of them. With --offload (colocated on
GPUs) one side is awake at a time: the critic for its values, the actor for its steps, the critic for its own,
then the actor again for the weight push."""

from __future__ import annotations

from typing import Any

from slime.loop.parts import EngineGroup
from slime.utils.rollout_batch import Rollout, TrainOutput


class ActorCritic:
    """A TrainGroup of an actor group and a critic group (module docstring). Both are
    slime.ray.train_group.RayTrainGroup: `train(rollout, values, update)`, `values`,
    `train_values`, and `save` / `save_hf` with the critic's place."""

    def __init__(
        self, actor: Any, critic: Any, num_critic_only_steps: int = 0, critic_save: str | None = None
    ):
        self.actor, self.critic = actor, critic
        self.num_critic_only_steps, self.critic_save = num_critic_only_steps, critic_save
        self.resumed_rollout_id = actor.resumed_rollout_id
        self.resumed_data_state = actor.resumed_data_state
        if critic.resumed_rollout_id != actor.resumed_rollout_id:
            fix = ""
            if (
                actor.resumed_rollout_id is not None
                and (critic.resumed_rollout_id or -1) > actor.resumed_rollout_id
            ):
                fix = (
                    " (a job that stopped between the two saves: the critic's "
                    f"iter_{actor.resumed_rollout_id:07d} is still there; write that rollout id into its "
                    "latest_checkpointed_iteration.txt)"
                )
            raise RuntimeError(
                f"the actor resumes after rollout {actor.resumed_rollout_id} but the critic's checkpoint "
                f"is of rollout {critic.resumed_rollout_id}: resume both from one save (--load, and "
                "--critic-save if it was given)" + fix
            )

    # ---- the step ---------------------------------------------------------------------------
    def train(self, rollout: Rollout) -> TrainOutput:
        self.actor.sleep()
        self.critic.wake()
        values = self.critic.values(rollout)
        self.critic.sleep()
        self.actor.wake()
        update = rollout.rollout_id >= self.num_critic_only_steps
        output = self.actor.train(rollout, values=values, update=update)
        self.actor.sleep()
        self.critic.wake()
        critic = self.critic.train_values(rollout, values, output.returns)
        self.critic.sleep()
        self.actor.wake()
        output.returns = None  # references of the ranks' returns, used above
        return merge(output, critic)

    # ---- the rest is the actor's, and the critic's checkpoints ------------------------------
    def save(self, rollout_id: int, data_state: dict[str, int] | None) -> None:
        """The critic first: the actor's checkpoint (the one --load resumes from) then completes
        the pair; a job that dies between the two leaves the critic one rollout ahead (see __init__)."""
        if self.critic_save is None:  # parse_args refuses --critic-save without --save
            raise RuntimeError("the critic has nowhere to save: give --save")
        self.critic.save(rollout_id, data_state, self.critic_save)
        self.actor.save(rollout_id, data_state)

    def push_weights(self, version: int) -> dict[str, Any]:
        return self.actor.push_weights(version)

    def connect(self, engines: EngineGroup, only: list[int] | None = None) -> None:
        self.actor.connect(engines, only)

    def ensure_connected(self, engines: EngineGroup) -> None:
        self.actor.ensure_connected(engines)

    def connected_to(self, engines: EngineGroup) -> bool:
        return bool(self.actor.connected_to(engines))

    def save_hf(self) -> None:
        """The actor's Hugging Face export (--save-hf), and the critic's beside it in <--save-hf>/critic
        (a token classifier; --critic-load takes it)."""
        self.actor.save_hf()
        self.critic.save_hf(critic=True)

    def wake(self) -> None:
        """Nothing yet: `train` wakes each side in turn (the critic first)."""

    def sleep(self, keep_params: bool = False) -> None:
        self.actor.sleep(keep_params)

    @property
    def transport(self) -> str | None:
        return getattr(self.actor, "transport", None)

    @property
    def hung(self) -> bool:
        return bool(getattr(self.actor, "hung", False) or getattr(self.critic, "hung", False))


def merge(actor: TrainOutput, critic: TrainOutput) -> TrainOutput:
    """The actor's output with the critic's: its step metrics as `critic-<name>` (slime's
    train/critic-* names) beside the actor's step for step, its rollout metrics (values, returns,
    explained_variance) with the actor's, its timings as `critic_train`; the perf metrics are the
    actor's."""
    steps = []
    for k in range(max(len(actor.steps), len(critic.steps))):
        step = dict(actor.steps[k]) if k < len(actor.steps) else {}
        if k < len(critic.steps):
            step.update({f"critic-{name}": value for name, value in critic.steps[k].items()})
        steps.append(step)
    timings = {**actor.timings, "critic_train": critic.timings.get("train", 0.0)}
    return TrainOutput(
        steps=steps,
        rollout={**actor.rollout, **critic.rollout},
        timings=timings,
        precision={**actor.precision, **critic.precision},
        perf=actor.perf,
    )
