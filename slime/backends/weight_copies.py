"""Copies of a rank's weights: another set swapped in for one pass (the reference, the OPD
teacher, an old version), and the versions it pushed, kept for --keep-old-actor.

--keep-old-actor takes the old policy's log-probs from the weights that generated the rollout.
Each rank keeps its part of the weights of every version it pushes (in host memory, the last
three: one step off-policy and --update-weights-interval need the one before the newest), and
the log-prob pass of a rollout runs with the version its samples report. Synchronously that is
the weights being trained; one step off (train_async.py) it is the version before (slime keeps
a queue of two copies rotated at each push, which lags one step more in train.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from slime.backends.interface import State, TrainBackend
from slime.utils.rollout_batch import BatchError, RolloutBatch

KEPT = 3


@contextlib.contextmanager
def swapped(backend: TrainBackend, state: State) -> Iterator[None]:
    """Context: `state` (a `snapshot`-shaped set of weights) is in the backend's model, its own
    weights are restored after."""
    saved = backend.snapshot()
    backend.copy_in(state)
    try:
        yield
    finally:
        backend.copy_in(saved)


def reference(backend: TrainBackend) -> contextlib.AbstractContextManager[None]:
    """Context: the reference's weights (`backend.ref_state`) are in the backend's model."""
    if backend.ref_state is None:
        raise RuntimeError("no reference model: the loss flags do not use one (--use-kl-loss / --kl-coef)")
    return swapped(backend, backend.ref_state)


class KeptWeights:
    """The weights of the versions a rank pushed (its part of them, on the host), newest last."""

    def __init__(self, backend: TrainBackend):
        self.backend = backend
        self.versions: dict[str, State] = {}

    def keep(self, version: str) -> None:
        """The backend's weights as pushed as `version`, kept; the oldest beyond `KEPT` go."""
        self.versions[version] = {
            k: v.detach().to("cpu", copy=True) for k, v in self.backend.snapshot().items()
        }
        for old in list(self.versions)[:-KEPT]:
            del self.versions[old]

    def generating(self, batch: RolloutBatch, mine: list[int]) -> contextlib.AbstractContextManager[None]:
        """Context: the kept weights of the version every sample was generated with, agreed over
        the ranks (BatchError, on all of them, for samples of several versions, of none reported,
        or of one not kept)."""
        local = {batch.weight_versions[p] for p in mine} if batch.weight_versions is not None else {None}
        everyone: list[Any] = [local]
        if dist.is_initialized():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, local)
        versions = set().union(*everyone)
        if len(versions) != 1 or None in versions or next(iter(versions)) not in self.versions:
            raise BatchError(
                "--keep-old-actor: the rollout's samples come from weight version(s) "
                f"{sorted(map(str, versions))}, the versions kept are {sorted(self.versions)}: each rollout "
                "must come from one pushed version (not with --fully-async or --partial-rollout, nor from "
                "a replayed dump)"
            )
        return swapped(self.backend, self.versions[next(iter(versions))])
