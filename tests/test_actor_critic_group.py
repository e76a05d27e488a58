"""slime.loop.critic.ActorCritic with recording fakes: the order of a PPO step (values, actor,
critic), one side awake at a time with --offload, the critic-only warm-up, what is merged, and a
resume whose two checkpoints disagree."""

from __future__ import annotations

import pytest

from slime.loop.critic import ActorCritic
from slime.utils.rollout_batch import Rollout, TrainOutput


class Fake:
    def __init__(self, name: str, calls: list, resumed: int | None = None):
        self.name, self.calls = name, calls
        self.resumed_rollout_id, self.resumed_data_state = resumed, None

    def __getattr__(self, method):
        def call(*args, **kwargs):
            self.calls.append((self.name, method, kwargs.get("update")))
            if method == "values":
                return ["values-ref"]
            if method == "train":
                assert kwargs["values"] == ["values-ref"]
                steps = [{"loss": 1.0}] if kwargs["update"] else []
                return TrainOutput(steps=steps, rollout={"reward": 0.5}, returns=["returns-ref"])
            if method == "train_values":
                assert args[1:] == (["values-ref"], ["returns-ref"])
                return TrainOutput(steps=[{"value_loss": 2.0}, {"value_loss": 1.5}], rollout={"values": 0.1})
            return None

        return call


def test_a_ppo_step_runs_values_actor_critic_with_one_side_awake_at_a_time():
    calls: list = []
    group = ActorCritic(Fake("actor", calls), Fake("critic", calls), num_critic_only_steps=1, critic_save="c")
    warm = group.train(Rollout(0, {}, 8, ()))
    assert [(who, what) for who, what, _ in calls] == [
        ("actor", "sleep"),
        ("critic", "wake"),
        ("critic", "values"),
        ("critic", "sleep"),
        ("actor", "wake"),
        ("actor", "train"),
        ("actor", "sleep"),
        ("critic", "wake"),
        ("critic", "train_values"),
        ("critic", "sleep"),
        ("actor", "wake"),
    ]
    assert calls[5][2] is False  # rollout 0 < --num-critic-only-steps 1: no actor step
    assert warm.steps == [{"critic-value_loss": 2.0}, {"critic-value_loss": 1.5}] and warm.returns is None
    calls.clear()
    out = group.train(Rollout(1, {}, 8, ()))
    assert calls[5] == ("actor", "train", True)
    assert out.steps == [{"loss": 1.0, "critic-value_loss": 2.0}, {"critic-value_loss": 1.5}]
    assert out.rollout == {"reward": 0.5, "values": 0.1}
    calls.clear()
    group.save(1, None)
    group.push_weights(2)
    group.save_hf()
    # The critic saves first: the actor's checkpoint, the one --load resumes from, completes the pair.
    assert calls == [
        ("critic", "save", None),
        ("actor", "save", None),
        ("actor", "push_weights", None),
        ("actor", "save_hf", None),
        ("critic", "save_hf", None),
    ]


def test_actor_and_critic_must_resume_the_same_rollout():
    with pytest.raises(
        RuntimeError, match="the actor resumes after rollout 3 but the critic's checkpoint is of rollout None"
    ):
        ActorCritic(Fake("actor", [], resumed=3), Fake("critic", []))
    with pytest.raises(RuntimeError, match="the critic has nowhere to save"):
        ActorCritic(Fake("actor", []), Fake("critic", [])).save(0, None)
