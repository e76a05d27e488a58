"""What the policy's and the critic's trainers share: a backend, the rank's plan of a rollout, and
the TrainActor calls that go straight to the backend (slime.backends.interface)."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

from slime.backends import planning
from slime.backends.interface import TrainBackend
from slime.config.train import TrainConfig
from slime.utils.rollout_batch import RolloutBatch, RolloutPart
from slime.utils.step_plans import StepPlan

B = TypeVar("B", bound=TrainBackend)
"""The backend a trainer drives (a subclass names its own, for its own methods)."""


class RankTrainer(Generic[B]):
    """One train rank: the step's logic (in the subclass) over a backend, which owns the model. A
    concrete trainer names its backend's class; both are built from the same arguments."""

    backend_class: type[B]

    def __init__(
        self,
        cfg: TrainConfig,
        rank: int | None = None,
        world_size: int | None = None,
        init_method: str | None = None,
    ):
        """`rank`, `world_size`, `init_method`: the train process group's (None: from the
        environment, as torchrun and the Ray actors set it)."""
        self.backend = self.backend_class(cfg, rank, world_size, init_method)

    @property
    def cfg(self) -> TrainConfig:
        return self.backend.cfg

    @property
    def rank(self) -> int:
        return self.backend.rank

    def init(self) -> dict[str, Any]:
        """Build the model (and reference), optimizer and schedule; resume from --load if set."""
        return self.backend.init()

    def plan(self, data: RolloutBatch | RolloutPart, max_tokens: int | None = None) -> list[StepPlan]:
        """This rank's micro-batches per optimizer step (slime.backends.planning)."""
        return planning.plan(self.cfg, self.backend, data, self.backend.hf_config, max_tokens)

    def log_prob_plans(self, data: RolloutBatch | RolloutPart, train_plans: list[StepPlan]) -> list[StepPlan]:
        """The log-prob passes' micro-batches (the training steps' unless a budget of their own)."""
        return planning.log_prob_plans(self.cfg, self.backend, data, train_plans, self.backend.hf_config)

    def check_vocabulary(self, batch: RolloutBatch, need_rollout_log_probs: bool = False) -> None:
        batch.validate(self.backend.hf_config.get_text_config().vocab_size, need_rollout_log_probs)

    def save(self, rollout_id: int, path: str, extra: dict[str, Any] | None = None) -> str:
        return self.backend.save(rollout_id, path, extra)

    def save_hf(self, path: str) -> None:
        self.backend.save_hf(path)

    def sleep(self, keep_params: bool = False) -> None:
        """Move optimizer states, and parameters unless `keep_params`, to host memory (no-op on
        --device cpu). The loop keeps the parameters through the weight push (exporting them
        all-gathers on the device) and releases them after it."""
        self.backend.sleep(keep_params)

    def wake(self) -> None:
        self.backend.wake()

    def close(self) -> None:
        self.backend.close()
